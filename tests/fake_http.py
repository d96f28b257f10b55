"""A JSON-over-HTTP server on 127.0.0.1 for tests that stand in for a retriever or an LLM endpoint."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONServer:
    """POST bodies are parsed as JSON and passed to respond(path, headers, body) -> (status, reply);
    a reply of None sends an empty error response with that status. Use as a context manager or close()."""

    def __init__(self, respond):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = respond(self.path, self.headers, body)
                if reply is None:
                    self.send_error(status)
                    return
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
