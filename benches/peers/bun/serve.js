// Bun as the benchmark's file-serving peer: `Bun.serve` over TLS answering GET with
// `Bun.file` from one root, as its documentation shows for static files: HTTP/1.1
// over TCP and, with its `http3` option, HTTP/3 on the same UDP port (Bun.serve
// speaks no h2). With `--h2`, `node:http2`'s `createSecureServer` instead, h2 only,
// each file sent with `respondWithFile`.
//
// bun serve.js --port PORT --root DIR --cert PEM --key PEM [--h2]
import { join, normalize, sep } from "node:path";

const options = {};
for (let i = 2; i < process.argv.length; i++) {
  const flag = process.argv[i];
  if (flag === "--h2") {
    options.h2 = true;
  } else if (flag.startsWith("--") && i + 1 < process.argv.length) {
    options[flag.slice(2)] = process.argv[++i];
  } else {
    console.error(`serve.js: unknown argument ${flag}`);
    process.exit(2);
  }
}
for (const name of ["port", "root", "cert", "key"]) {
  if (!options[name]) {
    console.error(`serve.js: --${name} is required`);
    process.exit(2);
  }
}
const root = normalize(options.root);

// The file under `root` that `pathname` names, or null if it would leave the root.
function resolve(pathname) {
  let decoded;
  try {
    decoded = decodeURIComponent(pathname);
  } catch {
    return null;
  }
  const path = normalize(join(root, decoded));
  return path.startsWith(root + sep) ? path : null;
}

const cert = await Bun.file(options.cert).text();
const key = await Bun.file(options.key).text();

if (options.h2) {
  const http2 = await import("node:http2");
  const server = http2.createSecureServer({ cert, key, minVersion: "TLSv1.3" });
  server.on("stream", (stream, headers) => {
    const path = resolve(new URL(headers[":path"], "https://bench").pathname);
    if (headers[":method"] !== "GET" || path === null) {
      stream.respond({ ":status": 404 });
      stream.end();
      return;
    }
    stream.respondWithFile(
      path,
      { "content-type": "application/octet-stream" },
      { onError: () => { stream.respond({ ":status": 404 }); stream.end(); } },
    );
  });
  server.listen(Number(options.port), "127.0.0.1", () => {
    console.error(`bun h2 listening on 127.0.0.1:${options.port}`);
  });
} else {
  const server = Bun.serve({
    hostname: "127.0.0.1",
    port: Number(options.port),
    tls: { cert, key },
    http3: true,
    async fetch(request) {
      const path = resolve(new URL(request.url).pathname);
      if (request.method !== "GET" || path === null) {
        return new Response("not found\n", { status: 404 });
      }
      const file = Bun.file(path);
      if (!(await file.exists())) {
        return new Response("not found\n", { status: 404 });
      }
      return new Response(file, { headers: { "content-type": "application/octet-stream" } });
    },
  });
  console.error(`bun listening on ${server.hostname}:${server.port}`);
}
process.on("SIGTERM", () => process.exit(0));
