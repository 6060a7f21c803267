"""What servetwin's own API server costs on this machine, term by term (the front-end model's structure).

    python benchmarks/frontend_costs.py [--requests 100] [--save PATH]

Part 1 times the pieces in-process: tokenisation per prompt token (the toy tokenizer the fake/sim
backends get, and the real Hugging Face tokenizers in the local model cache: SmolLM2 and a
Qwen3-vocabulary one), the chat template, incremental detokenisation per output token, and the msgspec
encode + decode of an engine request (per request, per prompt token) and of a step's outputs message
(per message, per output).

Part 2 runs `servetwin serve --backend fake` (unpaced, so the engine costs nothing) and sends requests
one at a time from one client while reading the API-server process's CPU time from /proc: CPU per
request for completions with short and long prompts (the per-token slope), the chat extra, and the
CPU per streamed chunk (a 65-token stream minus a 1-token one). Client-side latency is printed next to
it (it includes the engine process's hop).

`--save PATH` writes a front-end coefficient file (servetwin.sim.frontend; load it with
`frontend: {type: api_server, coefficients: PATH}`) with the measured figures as provenance.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from servetwin.core.engine import messages as m
from servetwin.core.engine.detokenizer import IncrementalDetokenizer
from servetwin.core.engine.llm import load_tokenizer
from servetwin.core.outputs import EngineCoreOutput
from servetwin.core.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]

MODEL_CACHE = Path(os.environ.get("SERVETWIN_MODEL_CACHE", Path.home() / ".cache" / "servetwin" / "models"))
HF_TOKENIZERS = ("smollm2-135m", "tiny-qwen3")


def best_of(fn, reps: int = 5) -> float:
    """Median of `reps` timings of fn() (seconds)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def text_of(tok, n_tokens: int) -> str:
    """A prompt of about `n_tokens` tokens for this tokenizer (decoded ids, like vLLM's random dataset)."""
    ids = [(7 * i + 13) % 5000 + 300 for i in range(n_tokens)]
    return tok.decode(ids)


def part1(log) -> dict:
    out: dict = {}
    toks = {"toy": load_tokenizer("toy", 32000)}
    for name in HF_TOKENIZERS:
        path = MODEL_CACHE / name
        if (path / "tokenizer.json").is_file():
            toks[name] = load_tokenizer(str(path))
    lens = [128, 512, 2000]
    log(f"{'tokenizer':<14}{'encode us/token':>16}{'encode fixed us':>16}{'chat template us':>18}"
        f"{'detok us/token':>16}")
    for name, tok in toks.items():
        texts = {n: text_of(tok, n) for n in lens}
        counts = {n: len(tok.encode(texts[n])) for n in lens}
        times = [best_of(lambda t=texts[n]: [tok.encode(t) for _ in range(20)]) / 20 for n in lens]
        a, b = slope([counts[n] for n in lens], times)
        conv = [{"role": "user", "content": texts[128]}]
        t_chat = best_of(lambda: [tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                                  for _ in range(50)]) / 50
        params = SamplingParams(max_tokens=256)
        prompt = tok.encode(texts[128])
        gen = [(11 * i + 29) % 5000 + 300 for i in range(256)]

        def detok(p=prompt, g=gen):
            d = IncrementalDetokenizer(tok, params, p)
            for t in g:
                d.update([t])
        t_detok = best_of(detok) / len(gen)
        out[name] = {"encode_per_token_s": b, "encode_fixed_s": a, "chat_template_s": t_chat,
                     "detok_per_token_s": t_detok}
        log(f"{name:<14}{b * 1e6:>16.3f}{a * 1e6:>16.1f}{t_chat * 1e6:>18.1f}{t_detok * 1e6:>16.2f}")
    enc, dec_in, dec_out = m.encoder(), m.input_decoder(), m.output_decoder()
    params = m.encode_params(SamplingParams(max_tokens=128))
    t_req = []
    for n in lens:
        msg = m.AddRequestMsg("req-1", list(range(1000, 1000 + n)), params, 0.0)
        t_req.append(best_of(lambda msg=msg: [dec_in.decode(enc.encode(msg)) for _ in range(200)]) / 200)
    a_req, b_req = slope(lens, t_req)
    sizes = [1, 16, 256]
    t_out = []
    for k in sizes:
        msg = m.OutputsMsg([EngineCoreOutput(f"req-{i}", [1234]) for i in range(k)], m.EngineStats())
        t_out.append(best_of(lambda msg=msg: [dec_out.decode(enc.encode(msg)) for _ in range(100)]) / 100)
    a_out, b_out = slope(sizes, t_out)
    out["msgspec"] = {"request_fixed_s": a_req, "request_per_token_s": b_req, "outputs_fixed_s": a_out,
                      "outputs_per_output_s": b_out}
    log(f"msgspec encode+decode: engine request {a_req * 1e6:.2f} us + {b_req * 1e9:.2f} ns/prompt token; "
        f"outputs message {a_out * 1e6:.2f} us + {b_out * 1e6:.3f} us/output")
    return out


# -- part 2: the server against the fake backend ---------------------------------------------------
def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def part2(n: int, tokenizer: str, log) -> dict:
    import httpx  # noqa: PLC0415
    from serve_process import wait_healthy  # noqa: PLC0415  (benchmarks/, the script's folder)

    port = _free_port()
    cmd = [sys.executable, "-m", "servetwin.experiments.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", "fake-model", "--backend", "fake", "--no-pace", "--max-num-seqs", "64"]
    if tokenizer != "toy":
        cmd += ["--tokenizer", tokenizer]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        tok = load_tokenizer(tokenizer, 32000)
        client = httpx.Client(timeout=60)
        prompts = {k: text_of(tok, k) for k in (128, 2000)}

        def measure(kind: str, plen: int, max_tokens: int, stream: bool) -> tuple[float, float]:
            if kind == "chat":
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompts[plen]}]}
            else:
                path, body = "/v1/completions", {"prompt": prompts[plen]}
            body.update(model="fake-model", max_tokens=max_tokens, ignore_eos=True, stream=stream)
            for _ in range(5):  # warm-up
                client.post(url + path, json=body).read()
            lat = []
            c0 = _cpu_s(proc.pid)
            for _ in range(n):
                t0 = time.perf_counter()
                if stream:
                    with client.stream("POST", url + path, json=body) as r:
                        for _ in r.iter_lines():
                            pass
                else:
                    client.post(url + path, json=body).read()
                lat.append(time.perf_counter() - t0)
            return (_cpu_s(proc.pid) - c0) / n, statistics.median(lat)

        res = {
            "completions_128": measure("completions", 128, 1, False),
            "completions_2000": measure("completions", 2000, 1, False),
            "chat_128": measure("chat", 128, 1, False),
            "stream_1": measure("completions", 128, 1, True),
            "stream_65": measure("completions", 128, 65, True),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    plen = {k: len(tok.encode(v)) for k, v in prompts.items()}
    per_token = (res["completions_2000"][0] - res["completions_128"][0]) / (plen[2000] - plen[128])
    out = {"tokenizer": tokenizer, "prompt_tokens": plen,
           "cpu_per_request_s": {k: v[0] for k, v in res.items()},
           "client_latency_p50_s": {k: v[1] for k, v in res.items()},
           "per_prompt_token_s": per_token,
           "request_fixed_s": res["completions_128"][0] - per_token * plen[128],
           "chat_extra_s": res["chat_128"][0] - res["completions_128"][0],
           "per_chunk_s": (res["stream_65"][0] - res["stream_1"][0]) / 64}
    log(f"server ({tokenizer} tokenizer, fake backend, {n} sequential requests per kind): API-server CPU per request")
    for k, (cpu, lat) in res.items():
        log(f"  {k:<18} cpu {cpu * 1e3:8.3f} ms   client latency p50 {lat * 1e3:8.3f} ms")
    log(f"  -> fixed {out['request_fixed_s'] * 1e3:.3f} ms + {per_token * 1e6:.3f} us/prompt token; chat extra "
        f"{out['chat_extra_s'] * 1e3:.3f} ms; per streamed chunk {out['per_chunk_s'] * 1e6:.1f} us")
    return out


def coefficients(p1: dict, p2: dict) -> dict:
    """Front-end coefficients from the measurements (servetwin.sim.frontend.FrontendCoefficients)."""
    ms = p1["msgspec"]
    hop = ms["request_fixed_s"]
    per_tok_total = max(p2["per_prompt_token_s"], 0.0)
    return {
        "c_req_s": max(p2["request_fixed_s"] - hop, 0.0),
        "c_chat_s": max(p2["chat_extra_s"], 0.0),
        # the server's measured per-token slope, less the message part (what tokenisation leaves)
        "c_prompt_token_s": max(per_tok_total - ms["request_per_token_s"], 0.0),
        "c_hop_s": max(hop, 0.0), "c_hop_token_s": max(ms["request_per_token_s"], 0.0),
        "c_step_s": ms["outputs_fixed_s"],
        "c_token_out_s": 0.0,  # one sequential stream cannot split per-token from per-chunk work
        "c_chunk_s": max(p2["per_chunk_s"], 0.0),
        "c_finish_s": max(p2["cpu_per_request_s"]["stream_1"] - p2["cpu_per_request_s"]["completions_128"], 0.0),
        # a 1-token answer at low load: client latency minus the server's CPU = the hops through the
        # engine process and back (the fake engine's step costs ~nothing); all of it put on the way in
        "latency_in_s": max(p2["client_latency_p50_s"]["completions_128"] - p2["cpu_per_request_s"]["completions_128"],
                            0.0),
        "latency_out_s": 0.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="sequential requests per kind (default 100)")
    ap.add_argument("--tokenizer", default="toy", help="the server's tokenizer: toy (default) or a path")
    ap.add_argument("--skip-server", action="store_true", help="part 1 only")
    ap.add_argument("--save", default=None, help="write a front-end coefficient YAML file here")
    args = ap.parse_args(argv)
    log = print
    p1 = part1(log)
    if args.skip_server:
        return 0
    p2 = part2(args.requests, args.tokenizer, log)
    coeffs = coefficients(p1, p2)
    log("front-end coefficients (servetwin.sim.frontend):")
    for k, v in coeffs.items():
        log(f"  {k:<18} {v:.3e}")
    if args.save:
        import yaml  # noqa: PLC0415

        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        doc = {"name": "servetwin-measured", "coefficients": coeffs, "provenance": {
            "source": "benchmarks/frontend_costs.py: servetwin's API server against the fake backend",
            "command": "python benchmarks/frontend_costs.py " + " ".join(argv or sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "python": platform.python_version(), "load_average_1m": load,
            "measurements": json.loads(json.dumps({"in_process": p1, "server": p2}))}}
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        with open(args.save, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        log(f"wrote {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
