"""One rank of tests/test_hf_export.py: a short Trainer run of a tiny Llama under STRATEGY that saves
a sharded checkpoint and exports Hugging Face folders while it trains (HFExport every batch).

    python hf_export_worker.py PRETRAINED OUT STRATEGY

The model is ``HuggingFaceModel.from_pretrained(PRETRAINED)`` (read into the sharded model); two
SGD steps change its weights; ``OUT/ck`` gets the sharded checkpoint, ``OUT/live`` the callback's
folders (ba1, ba2), and rank 0 writes ``OUT/expected.pt``: the model's whole state after the run
(gathered by the strategy), what every export must equal to the bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import kiln
from kiln.callbacks import HFExport
from kiln.models import HuggingFaceModel

PRETRAINED, OUT, STRATEGY = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def main() -> None:
    kiln.launch_from_torch(seed=0)
    model = HuggingFaceModel.from_pretrained(str(PRETRAINED))
    strategy = kiln.parallel.TensorParallel() if STRATEGY == "tp" else STRATEGY
    torch.manual_seed(0)
    ids = torch.randint(0, model.model.config.vocab_size, (8, 8))
    batches = [{"input_ids": ids[i : i + 2], "labels": ids[i : i + 2]} for i in range(0, 4, 2)]
    trainer = kiln.Trainer(
        model,
        train_dataloader=batches,
        max_duration="2ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
        strategy=strategy,
        save_folder=str(OUT / "ck"),
        save_interval="2ba",
        callbacks=[HFExport(OUT / "live", interval="1ba", max_shard_size="20KB")],
        progress_bar=False,
    )
    trainer.fit()
    state = trainer.engine.strategy.state_dict(trainer.engine.model, None, full=True)["model"]
    if kiln.context().rank == 0:
        torch.save({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, OUT / "expected.pt")
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
