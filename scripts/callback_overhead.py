"""Training throughput with the attention-map callback on and off, side by side.

    python scripts/callback_overhead.py --repeats 5 [hydra overrides ...]

Runs ``train(cfg)`` for one epoch of the default config (real MNIST, CPU unless an
override says otherwise) alternately with and without ``callbacks.attention_maps``, in
one process, and prints each run's training-loop images/s and whole-epoch images/s
(validation and map logging included), then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(callback_on: bool, overrides: list[str], out: Path) -> dict:
    # Imported here, after the command line is read: --help answers without torch.
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from vit_mnist.tasks.train import train

    GlobalHydra.instance().clear()
    extra = [] if callback_on else ["~callbacks.attention_maps"]
    base = ["trainer=cpu", "trainer.max_epochs=1", "test=false", "~callbacks.progress_bar"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*base, *extra, *overrides], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
        cfg.paths.data_dir = str(ROOT / "data")
        cfg.trainer.enable_progress_bar = False
        del cfg.hydra
    return train(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.depth=4")
    args = parser.parse_args()
    import torch  # after the parse: --help answers at once

    from vit_mnist.hardware import cpu_name

    logging.getLogger("lightning").setLevel(logging.WARNING)

    loop: dict[bool, list[float]] = {True: [], False: []}
    epoch: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            # Alternate the order so drifts in machine speed hit both sides alike.
            for on in (True, False) if i % 2 == 0 else (False, True):
                m = run_once(on, args.overrides, Path(tmp) / f"{i}_{on}")
                loop[on].append(m["train_images_per_s"])
                # One epoch of 55 000 images; train_time_s covers the whole fit.
                epoch[on].append(55_000 / m["train_time_s"])
                print(
                    f"run {i} callback {'on ' if on else 'off'}: train loop "
                    f"{loop[on][-1]:7.1f} images/s, whole epoch {epoch[on][-1]:7.1f} images/s",
                    flush=True,
                )
    print(f"\nhardware: {cpu_name()}, {torch.get_num_threads()} threads, {platform.platform()}")
    print(f"torch {torch.__version__}, overrides: {args.overrides or 'none'}")
    for name, values in (("train loop", loop), ("whole epoch", epoch)):
        on, off = statistics.median(values[True]), statistics.median(values[False])
        print(
            f"{name:12s} median images/s: callback on {on:7.1f}, off {off:7.1f}, "
            f"on/off = {on / off:.3f}"
        )


if __name__ == "__main__":
    main()
