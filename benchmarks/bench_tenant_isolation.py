"""What one tenant's hostile requests cost another (issue 39): a bystander's inter-token latency and the
server's RSS growth, without and with each attack, against the real HTTP app in this process.

The server is the tiny test model (tests/serve_support: CLI options -> configs -> state -> app -> uvicorn in
a thread) with two tenant keys, A (the attacker) and B (the bystander). B streams greedy unconstrained
completions (48 tokens each, ignore_eos) one after another while A's attack runs; each streamed chunk is one
token, so the gaps between chunks are B's inter-token latencies. RSS is this process's (the server's),
sampled every 20 ms: the growth is the peak during the attack over the RSS just before it. Attacks, scaled
down from the issue's so that each runs in well under a minute on 2 CPU cores:

- ambiguous grammar: 4 requests (n=4) constrained by ``s ::= s s | "a" | "the"``.
- schema flood: 24 distinct large JSON schemas from A at once, while B also sends trivial
  ``{"type": "integer"}`` constraints (their latency is reported too).
- prompt_logprobs x n: one request of 16 prompts x 100 tokens, n=16, prompt_logprobs=20 (not streamed).
- unread n=16 streams: two streamed n=16 requests (120 tokens, logprobs=5) whose client never reads.
- many constrained requests: 40 concurrent JSON-schema-constrained completions (32 tokens each) from A, so
  that most steps fill 40 constrained rows beside B's; reports A's statuses and the peak bytes counted to A
  in the structured-output caches (its compiled grammar and its live matchers). The default word-level test
  model cannot spell JSON (its requests fail, as the schema flood's do): run it with --byte-model (llguidance),
  --serial-masks for the masks one by one, --tenant-grammar-bytes to see the matchers' bound refuse some.

    python benchmarks/bench_tenant_isolation.py          # about 3 minutes on 2 shared cores
    python benchmarks/bench_tenant_isolation.py --only "many constrained requests" --serial-masks  # one by one

Prints a markdown table and writes results/bench_tenant_isolation-<time>.json. Wall-clock numbers on a
shared host are noisy: compare p50s, and a p99 only by its order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import httpx  # noqa: E402

from common import machine_description, markdown_table, percentile  # noqa: E402

log = logging.getLogger("bench_tenant_isolation")
KEYS = {"sk-tenant-a": {"name": "a", "base": True}, "sk-tenant-b": {"name": "b", "base": True}}
BYSTANDER = {"model": "base", "prompt": "the cat sat on the mat", "max_tokens": 48, "temperature": 0,
             "ignore_eos": True, "stream": True}
LONG_PROMPT = " ".join(["the cat sat on the mat and the dog said yes"] * 9)  # 99 words


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The peak RSS over a block, sampled every 20 ms in a thread."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.growth = self.peak - self.start


def bystander_run(base_url: str) -> list[float]:
    """One streamed completion of tenant B: the gaps (s) between its token chunks."""
    arrivals = []
    with httpx.stream("POST", base_url + "/v1/completions", json=BYSTANDER, timeout=600,
                      headers={"Authorization": "Bearer sk-tenant-b"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


def post(base_url: str, key: str, body: dict, route: str = "/v1/completions") -> tuple[int, float, int]:
    """(status, seconds, response bytes) of one request; an error's message is logged once per kind."""
    start, nbytes = time.monotonic(), 0
    # read as it comes and dropped: the client shares this process, and its copy must not count as the server's
    with httpx.stream("POST", base_url + route, json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        for chunk in response.iter_bytes():
            nbytes += len(chunk)
            if response.status_code != 200 and response.status_code not in _logged:
                _logged.add(response.status_code)
                log.info("%d: %s", response.status_code, chunk[:300])
    return response.status_code, time.monotonic() - start, nbytes


_logged: set[int] = set()


def big_schema(seed: int, num_properties: int = 60) -> dict:
    """A distinct large object schema (its property names carry the seed)."""
    props = {f"field_{seed}_{i}": ({"type": "integer", "minimum": i} if i % 3 == 0 else
                                   {"type": "string", "maxLength": 8 + i} if i % 3 == 1 else
                                   {"type": "array", "items": {"type": "number"}, "maxItems": 4})
             for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)[:10]}


def attack_ambiguous(base_url: str, state) -> dict:
    body = {"model": "base", "prompt": "the", "max_tokens": 32, "n": 4, "temperature": 1.0, "seed": 1,
            "structured_outputs": {"grammar": 'root ::= s\ns ::= s s | "a" | "the"'}}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: post(base_url, "sk-tenant-a", body), range(4)))
    return {"statuses": sorted({status for status, _, _ in results})}


def attack_schema_flood(base_url: str, state) -> dict:
    def schema_request(seed: int):
        body = {"model": "base", "prompt": "the", "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{seed}",
                                                                            "schema": big_schema(seed)}}}
        return post(base_url, "sk-tenant-a", body)

    trivial = {"model": "base", "prompt": "one", "max_tokens": 2,
               "response_format": {"type": "json_schema", "json_schema": {"name": "int",
                                                                           "schema": {"type": "integer"}}}}
    with ThreadPoolExecutor(26) as pool:
        flood = [pool.submit(schema_request, seed) for seed in range(24)]
        time.sleep(0.2)  # B's trivial constraints arrive behind A's flood
        trivial_runs = [pool.submit(post, base_url, "sk-tenant-b", trivial) for _ in range(2)]
        health_start = time.monotonic()
        httpx.get(base_url + "/health", timeout=600)
        health_s = time.monotonic() - health_start
        results = [f.result() for f in flood]
        trivial_results = [f.result() for f in trivial_runs]
    return {"statuses": sorted({s for s, _, _ in results}), "trivial_s": max(t for _, t, _ in trivial_results),
            "trivial_statuses": sorted({s for s, _, _ in trivial_results}), "health_s": health_s}


def attack_prompt_logprobs(base_url: str, state) -> dict:
    body = {"model": "base", "prompt": [LONG_PROMPT] * 16, "n": 16, "max_tokens": 2, "prompt_logprobs": 20}
    with ThreadPoolExecutor(3) as pool:  # three at once from one tenant
        results = list(pool.map(lambda _: post(base_url, "sk-tenant-a", body), range(3)))
    return {"statuses": sorted(status for status, _, _ in results), "attack_s": max(s for _, s, _ in results),
            "response_mib": max(nbytes for _, _, nbytes in results) / 2**20}


def attack_unread_streams(base_url: str, state) -> dict:
    port = int(base_url.rsplit(":", 1)[1])
    body = {"model": "base", "prompt": "the cat sat on the mat", "n": 16, "max_tokens": 120, "ignore_eos": True,
            "logprobs": 5, "temperature": 1.0, "seed": 3, "stream": True}
    socks = []
    for _ in range(2):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer sk-tenant-a\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        socks.append(sock)
    deadline = time.monotonic() + 120
    engine = state.engine.engine
    time.sleep(0.5)
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # what the finished streams still hold a second after the engine finished them
    seats = state._in_flight_per_tenant["a"]  # the attacker's (the bystander holds one while it runs)
    for sock in socks:
        sock.close()
    return {"statuses": ["unread"], "a_seats_held_after_done": seats}


CONSTRAINED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
    "type": "array", "items": {"type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"]}


def attack_many_constrained(base_url: str, state) -> dict:
    body = {"model": "base", "prompt": "the", "max_tokens": 32, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": CONSTRAINED_SCHEMA}}}
    structured = state.engine.engine.structured
    peak, done = [0], threading.Event()

    def sample() -> None:  # what A's grammar and live matchers count in the caches (after the first compile)
        while not done.wait(0.02):
            if structured._compiler is not None:
                peak[0] = max(peak[0], structured.compiler.queue.bytes_of("a"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda _: post(base_url, "sk-tenant-a", body), range(40)))
    done.set()
    sampler.join()
    statuses = [status for status, _, _ in results]
    return {"statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "a_structured_bytes_peak_mib": peak[0] / 2**20}


ATTACKS = {"ambiguous grammar": attack_ambiguous, "schema flood": attack_schema_flood,
           "prompt_logprobs x n": attack_prompt_logprobs, "two unread n=16 streams": attack_unread_streams,
           "many constrained requests": attack_many_constrained}


def measure(base_url: str, state, attack, min_runs: int) -> dict:
    """B's inter-token latencies over at least `min_runs` runs, while `attack` (None: nothing) runs."""
    gaps, extra = [], {}
    with PeakRSS() as rss, ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = None if attack is None else pool.submit(attack, base_url, state)
        runs = 0
        while runs < min_runs or (pending is not None and not pending.done()):
            gaps += bystander_run(base_url)
            runs += 1
        if pending is not None:
            extra = pending.result()
        seconds = time.monotonic() - start
    return {"itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3,
            "itl_max_ms": max(gaps) * 1e3, "bystander_runs": runs, "seconds": seconds,
            "rss_growth_mib": rss.growth / 2**20, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="bystander runs without an attack (and at least per attack)")
    parser.add_argument("--only", nargs="*", choices=list(ATTACKS), help="run only these attacks")
    parser.add_argument("--label", default="", help="a label stored in the JSON (e.g. before / after)")
    parser.add_argument("--byte-model", action="store_true",
                        help="serve the byte-level test model (llguidance reads its tokenizer: the guidance backend; "
                             "the default word-level one runs on xgrammar)")
    parser.add_argument("--tenant-grammar-bytes", type=int, default=None,
                        help="--structured-outputs-tenant-cache-bytes (default: the engine's, 256 MiB)")
    parser.add_argument("--serial-masks", action="store_true",
                        help="fill a step's guidance masks one by one (the engine's batch fill off)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    from factories import save_tiny_model
    from serve_support import model_with_chat_template, serve_args, start_server

    with tempfile.TemporaryDirectory() as root:
        if args.byte_model:
            from structured_support import save_byte_checkpoint

            model_dir, _ = save_byte_checkpoint(Path(root))
        else:
            save_tiny_model(Path(root) / "src", "llama", seed=0)
            model_dir = model_with_chat_template(str(Path(root) / "src"), Path(root) / "model")
        keys = Path(root) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        bound = [] if args.tenant_grammar_bytes is None else [
            "--structured-outputs-tenant-cache-bytes", str(args.tenant_grammar_bytes)]
        server, state = start_server(serve_args(model_dir, {}, extra=[
            "--tenant-keys", str(keys), "--max-num-seqs", "48", "--stream-send-timeout", "600", *bound]))
        state.engine.engine.structured.parallel_fill = not args.serial_masks
        try:
            bystander_run(server.base_url)  # warm-up
            rows = [{"scenario": "(no attack)", **measure(server.base_url, state, None, args.runs)}]
            log.info("%s", rows[-1])
            for name, attack in ATTACKS.items():
                if args.only and name not in args.only:
                    continue
                rows.append({"scenario": name, **measure(server.base_url, state, attack, 1)})
                log.info("%s", rows[-1])
        finally:
            server.stop()
    columns = [("scenario", "attack", ""), ("itl_p50_ms", "B ITL p50 ms", ".1f"), ("itl_p99_ms", "B ITL p99 ms", ".1f"),
               ("itl_max_ms", "B ITL max ms", ".0f"), ("rss_growth_mib", "RSS growth MiB", ".1f"),
               ("seconds", "attack s", ".1f")]
    print(markdown_table(rows, columns))
    structured = state.engine.engine.structured
    backend = structured.compiler.backend.name if structured._compiler is not None else None
    print(f"structured-output backend: {backend}{' (masks one by one)' if args.serial_masks else ''}")
    for row in rows[1:]:
        notes = {k: v for k, v in row.items() if k not in dict((c[0], 0) for c in columns)
                 and k not in ("bystander_runs",)}
        print(f"- {row['scenario']}: {notes}")
    out = ROOT / "results" / f"bench_tenant_isolation-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "serial_masks": args.serial_masks, "byte_model": args.byte_model,
                              "structured_backend": backend, "machine": machine_description("cpu"), "rows": rows},
                             indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
