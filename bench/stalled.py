"""What streaming clients that stop reading cost a server: opens N streaming
requests that never read their replies and samples the server process's RSS
(VmRSS) until they end or `--seconds` pass.

    python -m bench.stalled --base-url http://127.0.0.1:8000 --pid <edge pid> \
        --clients 4 --n 16 --seconds 60

A client's socket has a 4 KiB receive buffer, so the server's side of each
connection fills soon. Prints one line per sample: seconds and RSS in MiB.
"""
from __future__ import annotations

import argparse
import json
import socket
import time
from urllib.parse import urlsplit


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_stalled(url: str, body: dict) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port or 80))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (parts.netloc.encode(), len(payload), payload))
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--pid", type=int, required=True, help="the process whose RSS is sampled (the edge)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--n", type=int, default=16, help="choices per request")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--top-logprobs", type=int, default=0, help="> 0: ask for logprobs (larger chunks)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    args = parser.parse_args()
    body = {"model": args.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "stream": True, "n": args.n, "temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    if args.top_logprobs:
        body.update(logprobs=True, top_logprobs=args.top_logprobs)
    start, before = time.monotonic(), rss_mib(args.pid)
    sockets = [open_stalled(args.base_url, body) for _ in range(args.clients)]
    print(f"{0:6.1f} s  {before:8.1f} MiB", flush=True)
    try:
        while (elapsed := time.monotonic() - start) < args.seconds:
            time.sleep(min(args.every, args.seconds - elapsed))
            print(f"{time.monotonic() - start:6.1f} s  {rss_mib(args.pid):8.1f} MiB", flush=True)
    finally:
        for sock in sockets:
            sock.close()


if __name__ == "__main__":
    main()
