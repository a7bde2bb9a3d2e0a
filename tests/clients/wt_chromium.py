"""A real browser's WebTransport: headless Chromium, driven over the W3C WebDriver
protocol (chromedriver, plain HTTP on loopback, no Python dependencies), opens a
session to the diagnostic endpoint with `serverCertificateHashes`, echoes a stream
and a datagram, and closes. QUIC stays enabled (no --disable-quic).

The page runs from http://127.0.0.1:PAGE_PORT/ (a potentially trustworthy origin,
so a secure context), which the endpoint must allow.

usage: wt_chromium.py WT_URL CERT_SHA256_BASE64 PAGE_PORT DRIVER_PORT

Prints one JSON line: {"ok": ..., "stream": ..., "datagram": ..., "error": ...}.
"""

import http.server
import json
import subprocess
import sys
import threading
import time
import urllib.request

SCRIPT = """
const [url, hash, done] = arguments;
(async () => {
  try {
    const value = Uint8Array.from(atob(hash), c => c.charCodeAt(0));
    const wt = new WebTransport(url, {serverCertificateHashes: [{algorithm: "sha-256", value}]});
    await wt.ready;
    const stream = await wt.createBidirectionalStream();
    const writer = stream.writable.getWriter();
    await writer.write(new TextEncoder().encode("hello from chromium"));
    await writer.close();
    const reader = stream.readable.getReader();
    const got = [];
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      got.push(...value);
    }
    let datagram = null;
    const dr = wt.datagrams.readable.getReader();
    dr.read().then(d => { datagram = new TextDecoder().decode(d.value); });
    const dw = wt.datagrams.writable.getWriter();
    for (let i = 0; i < 50 && datagram === null; i++) {
      await dw.write(new TextEncoder().encode("datagram " + i));
      await new Promise(r => setTimeout(r, 100));
    }
    wt.close({closeCode: 0, reason: "done"});
    await wt.closed;
    done({ok: true, stream: new TextDecoder().decode(new Uint8Array(got)), datagram});
  } catch (e) {
    done({ok: false, error: String(e)});
  }
})();
"""


def call(port, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["value"]


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"<!doctype html><title>webship webtransport</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main():
    url, cert_hash, page_port, driver_port = sys.argv[1:5]
    page = http.server.ThreadingHTTPServer(("127.0.0.1", int(page_port)), Page)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    driver = subprocess.Popen(
        ["chromedriver", f"--port={driver_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    session = None
    try:
        for _ in range(100):
            try:
                call(driver_port, "GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        caps = {
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {
                        "binary": "/usr/bin/chromium",
                        "args": [
                            "--headless=new",
                            "--no-sandbox",
                            "--disable-gpu",
                            "--disable-dev-shm-usage",
                            "--no-first-run",
                        ],
                    },
                }
            }
        }
        session = call(driver_port, "POST", "/session", caps)["sessionId"]
        call(driver_port, "POST", f"/session/{session}/timeouts", {"script": 60000})
        call(driver_port, "POST", f"/session/{session}/url", {"url": f"http://127.0.0.1:{page_port}/"})
        result = call(
            driver_port,
            "POST",
            f"/session/{session}/execute/async",
            {"script": SCRIPT, "args": [url, cert_hash]},
        )
        print(json.dumps(result))
    finally:
        if session is not None:
            try:
                call(driver_port, "DELETE", f"/session/{session}")
            except OSError:
                pass
        driver.terminate()
        driver.wait(10)
        page.shutdown()


main()
