"""full_model_state_dict of a HuggingFaceModel under several strategies on 2 ranks.

Usage: kiln run -n 2 state_dict_contract_worker.py OUT CASE ... Each case builds the tiny Llama
(tests/workers/hf_common.py, 2 layers) under the Engine with that strategy and takes
``full_model_state_dict`` of the Engine and of its model. Rank 0 writes OUT/contract.json:
{case: {"types": [value type names], "keys": [...], "extra_keys": [...], "config_layers": int,
"max_diff": float}}, where max_diff compares the weights (moved with ``v.cpu()``) with the
one-process model's and extra_keys are the keys ``extra_state=True`` adds.
"""

import json
import sys

import torch
import torch.distributed as dist

import kiln
from hf_common import LAYERS, make_model
from kiln.parallel import Hybrid, TensorParallel, full_model_state_dict

CASES = {
    "ddp": lambda: "ddp",
    "zero3": lambda: "zero3",
    "tp": lambda: TensorParallel(),
    "pp": lambda: Hybrid(pp=2, split_points=LAYERS[1:2], microbatches=2),
}


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    kiln.launch_from_torch(seed=0)
    reference = {k: v for k, v in make_model(num_hidden_layers=2).state_dict().items() if torch.is_tensor(v)}
    results = {}
    for case in cases:
        model = make_model(num_hidden_layers=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = kiln.Engine(model, opt, strategy=CASES[case]())
        for source in (engine, engine.model):
            state = full_model_state_dict(source)
            cpu = {k: v.cpu() for k, v in state.items()}  # what the contract promises works
            extra = full_model_state_dict(source, extra_state=True)
            added = sorted(set(extra) - set(state))
            config = json.loads(extra[added[0]])["config"] if added else {}
            results[f"{case}/{'engine' if source is engine else 'model'}"] = {
                "types": sorted({type(v).__name__ for v in state.values()}),
                "keys": sorted(state),
                "extra_keys": added,
                "config_layers": config.get("num_hidden_layers"),
                "max_diff": max((cpu[k] - reference[k]).abs().max().item() for k in reference),
            }
        del engine
    if dist.get_rank() == 0:
        with open(f"{out}/contract.json", "w") as f:
            json.dump({"reference_keys": sorted(reference), **results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
