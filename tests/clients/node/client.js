// A client of splitserve's public API in Node.js, built at run time from protos/ alone (the
// include root, as for every language): no generated code, no Python. The test suite runs it
// against `splitserve up` (tests/clients/test_node_client.py); it doubles as an example.
//
//   node client.js ADDRESS info
//       ModelInfo (with the instances' stats) as one JSON line.
//   node client.js ADDRESS stream REQUEST_JSON [--cancel-after N]
//       GenerateStream: one JSON line per message; with --cancel-after N the call is cancelled
//       once N tokens have arrived, and the last line is {"cancelled": true, "tokens": N'}.
//
// REQUEST_JSON is a GenerateStreamRequest in proto3 JSON field names, e.g.
//   '{"prompt": "Hello", "params": {"max_tokens": 8, "temperature": 0}}'
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "..", "protos");

function loadApi() {
  const definition = protoLoader.loadSync("splitserve/v1/generation.proto", {
    includeDirs: [PROTOS],
    keepCase: true, // field names as in the .proto (snake_case)
    longs: Number,
    enums: String,
    defaults: false,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).splitserve.v1;
}

function fail(message) {
  process.stderr.write(`${message}\n`);
  process.exit(2);
}

function out(value) {
  process.stdout.write(`${JSON.stringify(value)}\n`);
}

function info(client) {
  client.ModelInfo({ include_instances: true }, { deadline: Date.now() + 10000 }, (err, reply) => {
    if (err) fail(`ModelInfo: ${err.code} ${err.details}`);
    out(reply);
  });
}

function stream(client, request, cancelAfter) {
  const call = client.GenerateStream(request, { deadline: Date.now() + 120000 });
  let tokens = 0;
  let cancelled = false;
  call.on("data", (msg) => {
    if (cancelled) return;
    tokens += msg.token_ids.length;
    out(msg);
    if (cancelAfter !== null && tokens >= cancelAfter) {
      cancelled = true;
      call.cancel();
      out({ cancelled: true, tokens });
    }
  });
  call.on("error", (err) => {
    if (cancelled && err.code === grpc.status.CANCELLED) return;
    fail(`GenerateStream: ${err.code} ${err.details}`);
  });
}

function main(argv) {
  const [address, command, requestJson, ...rest] = argv;
  if (!address || !command) fail("usage: node client.js ADDRESS info|stream [REQUEST_JSON]");
  const api = loadApi();
  const client = new api.GenerationService(address, grpc.credentials.createInsecure());
  if (command === "info") return info(client);
  if (command !== "stream") fail(`unknown command ${command}`);
  if (!requestJson) fail("stream needs a request in JSON");
  let cancelAfter = null;
  if (rest[0] === "--cancel-after") cancelAfter = Number(rest[1]);
  return stream(client, JSON.parse(requestJson), cancelAfter);
}

main(process.argv.slice(2));
