// The official AsyncAPI parser (@asyncapi/parser, pinned in the Makefile) on one document: prints its
// diagnostics as JSON, one object each ({code, severity, message, path}; severity 0 is an error, 1 a warning,
// 2 information, 3 a hint). Run by tests/unit/test_asyncapi_parser.py: node tests/asyncapi_parse.cjs <npm prefix> <file>.
"use strict";
const { createRequire } = require("node:module");
const { readFileSync } = require("node:fs");
const path = require("node:path");

const [parserDir, file] = process.argv.slice(2);
const { Parser } = createRequire(path.join(path.resolve(parserDir), "package.json"))("@asyncapi/parser");

new Parser()
  .parse(readFileSync(file, "utf8"), { source: path.resolve(file) })
  .then(({ diagnostics }) => {
    const found = diagnostics.map(({ code, severity, message, path: where }) => ({ code, severity, message, path: where }));
    process.stdout.write(JSON.stringify(found) + "\n");
  })
  .catch((error) => {
    process.stderr.write(`${error.stack || error}\n`);
    process.exit(2);
  });
