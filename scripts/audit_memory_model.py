"""The planner's device peak against the executor's measured one, over model families, job kinds
and plan families (CPU device, op temporaries counted: what autograd and the ops allocate too).

    .venv/bin/python scripts/audit_memory_model.py                 # ~1 min on 2 cores
    .venv/bin/python scripts/audit_memory_model.py --cases qwen3-moe,llama --plans acts_host --seqs 256

Each case is a small randomly initialised HF model (hidden 256, 3 blocks; MoE: 16-32 experts, top
4), trained two steps by `StreamingExecutor(count_op_temporaries=True)` under a hand-written plan of
each family (`lazytrain.runtime.testing.plan_families`), at batch 2 x each sequence length. The
prediction is `plan.simulate.memory_peaks` for the same plan: the number the MILP constrains.
"measured > predicted" is the dangerous direction (a plan that does not fit); the table marks it.
`recompute_all` and `mixed_segments` keep their recompute segments on blocks here (the families'
versions put the embedding or head in one, which the planner never emits and its model refuses to
predict); at 3 blocks `mixed_segments` is one one-block segment. The table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lazytrain.models.lora import apply_lora  # noqa: E402
from lazytrain.runtime.testing import (hand_plan, hardware_for_tests, plan_families,  # noqa: E402
                                       planned_device_peak, random_batches, steps_counting_op_temporaries,
                                       tiny_model)
from lazytrain.spec import JobSpec  # noqa: E402

DENSE = dict(hidden_size=256, intermediate_size=704)
QWEN3_MOE = dict(hidden_size=256, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4,
                 mlp_only_layers=[], head_dim=64)
# label: (family, config overrides, weights dtype, JobSpec fields, micro-batches, LoRA)
CASES = {
    "llama": ("llama", DENSE, "bfloat16", {}, 1, False),
    "qwen3": ("qwen3_moe", dict(DENSE, head_dim=64, mlp_only_layers=[0, 1, 2]), "bfloat16", {}, 1, False),
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE, "bfloat16", {}, 1, False),
    "qwen2-moe": ("qwen2_moe", dict(hidden_size=256, moe_intermediate_size=128, num_experts=16,
                                    num_experts_per_tok=4, shared_expert_intermediate_size=256),
                  "bfloat16", {}, 1, False),
    "olmoe": ("olmoe", dict(hidden_size=256, intermediate_size=128, num_experts=16, num_experts_per_tok=4),
              "bfloat16", {}, 1, False),
    "mixtral": ("mixtral", dict(hidden_size=256, intermediate_size=128, num_local_experts=32,
                                num_experts_per_tok=4), "bfloat16", {}, 1, False),
    "llama-lora": ("llama", DENSE, "bfloat16", {"mode": "lora"}, 1, True),
    "qwen3-moe-lora": ("qwen3_moe", QWEN3_MOE, "bfloat16", {"mode": "lora"}, 1, True),
    "llama-fp32": ("llama", DENSE, "float32", {"compute_dtype": "fp32"}, 1, False),
    "llama-accum2": ("llama", DENSE, "bfloat16", {"grad_accum": 2}, 2, False),
    "llama-clip": ("llama", DENSE, "bfloat16", {"clip_grad": True}, 1, False),
    "llama-chunked-loss": ("llama", DENSE, "bfloat16", {"loss_chunk_tokens": 128}, 1, False),
    "qwen2-tied": ("qwen2-tied", DENSE, "bfloat16", {}, 1, False),
}
PLANS = ("all_resident", "acts_host", "acts_nvme", "params_host", "params_nvme", "mixed_segments",
         "recompute_all")


def audit_plan_kwargs(blocks: int, name: str) -> dict:
    """hand_plan arguments of plan family `name`, with recompute segments over blocks only: the
    planner never puts the embedding or the head in one, and the cost model refuses to predict such
    a plan (the families of the exactness tests do, which crashed this script: review)."""
    kw = dict(plan_families(blocks)[name])
    if name == "mixed_segments":
        kw["segments"] = [(1, 2), (blocks - 1, blocks)] if blocks >= 4 else [(1, 1)]
    elif name == "recompute_all":
        kw["segments"] = [(1, blocks)]
    return kw
VOCAB = 1024


def measure(label: str, plan_name: str, seq: int) -> tuple[int, int]:
    family, over, dtype, job_kw, n_micro, lora = CASES[label]
    base = tiny_model(family, vocab_size=VOCAB, dtype=dtype, **over)
    blocks = base.config.num_hidden_layers
    job = JobSpec(**{"batch_size": 2, "seq_len": seq, "compute_dtype": "bf16", **job_kw})
    hw = hardware_for_tests()
    plan = hand_plan(blocks, job=job, hardware=hw, **audit_plan_kwargs(blocks, plan_name))
    predicted = planned_device_peak(base, plan)
    model = copy.deepcopy(base)
    if lora:
        model = apply_lora(model, job.lora_rank, job.lora_alpha, job.lora_targets)
    batches = random_batches(n_micro, seed=0, batch=2, seq=seq, vocab=VOCAB)
    with tempfile.TemporaryDirectory() as nvme_dir:
        res = steps_counting_op_temporaries(model, plan, batches, nvme_dir=nvme_dir,
                                            max_grad_norm=1.0 if job.clip_grad else None)
    return predicted, max(r.device_peak_bytes for r in res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of: {', '.join(PLANS)}")
    ap.add_argument("--seqs", default="64,256", help="sequence lengths (batch 2)")
    args = ap.parse_args()
    cases, plans = args.cases.split(","), args.plans.split(",")
    for name in cases:
        if name not in CASES:
            ap.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
    for name in plans:
        if name not in PLANS:
            ap.error(f"unknown plan {name!r}; choose from {', '.join(PLANS)}")
    rows = []
    for label in cases:
        for plan_name in plans:
            for seq in (int(s) for s in args.seqs.split(",")):
                predicted, measured = measure(label, plan_name, seq)
                rows.append((label, plan_name, 2 * seq, predicted, measured))
                print(f"{label} {plan_name} {2 * seq} tokens: predicted {predicted / 2**20:.2f} MiB, "
                      f"measured {measured / 2**20:.2f} MiB", flush=True)
    print()
    print(f"{'case':<20} {'plan':<15} {'tokens':>6} {'predicted MiB':>14} {'measured MiB':>13} {'meas/pred-1':>10}")
    print("-" * 84)
    under = 0
    for label, plan_name, tokens, predicted, measured in rows:
        flag = ""
        if measured > predicted:
            flag = "  MEASURED ABOVE THE PLAN"
            under += 1
        print(f"{label:<20} {plan_name:<15} {tokens:>6} {predicted / 2**20:>14.2f} {measured / 2**20:>13.2f} "
              f"{measured / predicted - 1:>+9.1%}{flag}")
    print(f"planner-shaped plans measured above their prediction: {under}")


if __name__ == "__main__":
    main()
