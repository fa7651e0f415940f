"""What the tokenizer's key decision costs a chat call: `KeyGate.admit` (look
the key up among N digests, check and take its limits, count it in metrics)
and the tokens taken at the end, against the same with keys off, in
interleaved rounds; median and p90 of the µs per call.

    PYTHONPATH=gen:. .venv/bin/python -m bench.key_gate_cost --keys 10 100 1000

This is the cost of limits counted in memory where every call lands; a shared
limiter (Envoy's ratelimit service and Redis) adds a network round trip per
call on top (docs/operating/security.md)."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.common.api_keys import KeyStore
from services.tokenizer.key_gate import KeyGate, KeyMetrics

LIMITS = "requests_per_second=1e9 max_concurrent=1000 tokens_per_minute=1000000000000"


def gate_with(num_keys: int, directory: Path) -> KeyGate:
    key_file = directory / f"keys-{num_keys}"
    key_file.write_text("".join(f"sk-bench-{i:06d} name=team-{i} {LIMITS}\n" for i in range(num_keys)))
    return KeyGate(KeyStore(key_file=str(key_file)), KeyMetrics(CollectorRegistry()))


def us_per_call(gate: KeyGate, metadata: dict[str, str], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        with gate.admit(metadata) as admission:
            admission.add_tokens(300)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5000, help="calls per timed round")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="key-gate-"))
    gates = {"keys off": (KeyGate(KeyStore()), {})}
    for num_keys in args.keys:
        # The key looked up is the last one: every digest is compared anyway.
        gates[f"{num_keys} keys"] = (gate_with(num_keys, directory),
                                     {"authorization": f"Bearer sk-bench-{num_keys - 1:06d}"})
    times: dict[str, list[float]] = {name: [] for name in gates}
    for round_ in range(args.rounds):
        order = list(gates) if round_ % 2 == 0 else list(reversed(gates))
        for name in order:
            gate, metadata = gates[name]
            times[name].append(us_per_call(gate, metadata, args.calls))
    print(f"{'':>10}  median µs/call  p90 µs/call")
    for name, values in times.items():
        p90 = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
        print(f"{name:>10}  {statistics.median(values):14.1f}  {p90:11.1f}")


if __name__ == "__main__":
    main()
