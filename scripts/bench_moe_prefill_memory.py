"""Benchmark: host memory of a streamed MoE prefill, experts read in place vs gathered.

    .venv/bin/python scripts/bench_moe_prefill_memory.py            # ~1-2 min on 2 cores

A random-init Mixtral-shaped model (4 layers, 8 experts of 3 x 512 x 1536 fp32 weights each) is
converted to an expert store, then each mode runs in its own process, three
rounds interleaved: the cache at its minimum (one layer's experts, 8 slots), a 256-token prompt
that routes to every expert of every layer, one warm-up prefill and five timed ones.
The figure is the process's peak RSS during the prefills above its RSS before them (the peak
reset first through /proc/self/clear_refs). Modes: `in place` (the engine's default with the grouped_mm kernel: the kernel reads the cache
pool's slots), `gathered` (the routed experts copied out of the pool first: what every kernel did
before 2026-12-01, and what the eager kernel still does), and the peer, the all-resident HF model
(same kernel, same prompt). Prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=512)
MODES = ("in place", "gathered", "all-resident HF")


def build(d: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from lazytrain.moe import convert_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **SHAPE)).eval()
    with torch.no_grad():   # sharper routers: routing differs between tokens
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == SHAPE["num_local_experts"]:
                p.normal_(0, 0.5)
    convert_model(model, d / "store")
    model.save_pretrained(d / "hf")


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_mib() -> float:
    return _status("VmRSS")


def _peak_mib() -> float:
    return _status("VmHWM")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current RSS (Linux >= 4.0)


def child(d: Path, mode: str, tokens: int) -> dict:
    torch.set_num_threads(2)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    eng = None
    if mode == "all-resident HF":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(d / "hf")).eval()
    else:
        from lazytrain.moe import load_streamed

        eng = load_streamed(d / "store", cache_slots=SHAPE["num_local_experts"], prefetch="none")
        eng.zero_copy = mode == "in place"
        model = eng.model
    times = []
    base = _rss_mib()
    _reset_peak()   # the peak from here on: loading the model is not the prefill
    with torch.no_grad():
        model(ids)
        for _ in range(5):
            t = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t)
    out = {"ms": statistics.median(times) * 1e3, "peak_mib": _peak_mib() - base,
           "cache_mib": eng.cache.pool.nbytes / 2**20 if eng else 0.0, "kernel": eng.base_name if eng else "grouped_mm"}
    if eng is not None:
        eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--child", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.tokens)))
        return
    with tempfile.TemporaryDirectory(prefix="lt_moe_mem_") as tmp:
        d = Path(tmp)
        build(d)
        res: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for m in MODES:
                p = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--child", tmp, m],
                                   capture_output=True, text=True, check=True)
                res[m].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{m} {res[m][-1]['peak_mib']:.0f} MiB" for m in MODES), file=sys.stderr, flush=True)
    base = statistics.median(x["peak_mib"] for x in res["gathered"])
    peer_ms = statistics.median(x["ms"] for x in res["all-resident HF"])
    print(f"\nStreamed MoE prefill, {args.tokens} tokens, Mixtral-shaped 4 x 8 experts "
          f"({res['in place'][0]['cache_mib']:.0f} MiB of experts per layer = the cache), kernel "
          f"{res['in place'][0]['kernel']}, medians over {args.rounds} processes per mode")
    print(f"{'mode':18s} {'prefill peak MiB':>17s} {'vs gathered':>12s} {'prefill ms':>11s} {'vs HF':>7s}")
    print("-" * 69)
    for m in MODES:
        rss = statistics.median(x["peak_mib"] for x in res[m])
        ms = statistics.median(x["ms"] for x in res[m])
        print(f"{m:18s} {rss:17.0f} {rss - base:+12.0f} {ms:11.1f} {ms / peer_ms:6.2f}x")
    print("prefill peak: peak RSS during the prefills above the RSS before them (the streamed modes' "
          "first prefill also faults in the cache pool)")


if __name__ == "__main__":
    main()
