"""dit-accel against the original DiT code on a small real data set, in pixel space (issue 13).

The data: scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), upscaled to 16 px RGB and written
as an image folder (DIR/<digit>/<n>.png). A logistic-regression classifier trained on the real digits (16 px,
grey) scores the samples: the share of samples it reads as the digit they were drawn for.

dit-accel's side runs through its own CLI only: `dit-plan` (pixel latents, a 4-block DiT, hidden 128, 4 heads,
patch 2), `python -m dit_accel.train`, `dit-accel sample`. The original side runs only when given a checkout
of facebookresearch/DiT OUTSIDE this repository (`--original-dit PATH`; it is CC-BY-NC and none of it is
copied here): this script imports its `models.DiT` and `diffusion.create_diffusion` from that path and trains
them with a minimal loop written here that follows the original train.py's recipe (AdamW with weight decay
0, the EMA updated after every step from an exact copy, class dropout inside the model, uniform timesteps,
the mse + vb loss, random horizontal flips, pixels normalised to [-1, 1]). Its EMA weights are then read
into dit-accel (`dit-accel import-dit`) and sampled by the same `dit-accel sample` command as dit-accel's
own run, so the only difference between the two sides is training.

    python benchmarks/digits_compare.py --out /tmp/digits-results --original-dit /tmp/DiT --seeds 0,1,2

writes RESULTS/curves.csv (side, seed, step, loss), RESULTS/scores.json (per side and seed: the share
correct, per class, wall time) and RESULTS/summary.md. Figures: docs/digits-comparison.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESOLUTION = 16
NETWORK = ["--depth", "4", "--hidden", "128", "--heads", "4", "--patch", "2", "--num-classes", "10"]

# timm (the original's Attention, Mlp, PatchEmbed) imports torchvision at import time; a CPU venv has none.
# This stub answers those imports with placeholders; nothing the DiT network uses comes from it.
TORCHVISION_STUB = """
import enum, importlib.abc, importlib.machinery, sys, types
class InterpolationMode(enum.Enum):
    NEAREST = "nearest"; BILINEAR = "bilinear"; BICUBIC = "bicubic"; BOX = "box"; HAMMING = "hamming"
    LANCZOS = "lanczos"
class _Placeholder:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision stub: not available")
def __getattr__(name):
    if name == "InterpolationMode":
        return InterpolationMode
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Placeholder,), {})
__version__ = "0.0.0+stub"
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__getattr__ = [], __getattr__
        return module
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Finder())
"""


# --- data and the classifier -------------------------------------------------------------------------


def write_digits(folder: Path) -> int:
    """sklearn's digits as 16 px RGB PNGs in class folders 0..9 (bilinear upscaling of the 0..16 values)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    if folder.exists():
        return len(digits.images)
    staging = folder.with_name(folder.name + ".partial")
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        grey = Image.fromarray((image * (255.0 / 16.0)).round().astype(np.uint8), "L")
        (staging / str(label)).mkdir(parents=True, exist_ok=True)
        grey.resize((RESOLUTION, RESOLUTION), Image.BILINEAR).convert("RGB").save(
            staging / str(label) / f"{index:04d}.png"
        )
    staging.rename(folder)
    return len(digits.images)


def grey_features(rgb_uint8: np.ndarray) -> np.ndarray:
    """(N, H, W, 3) uint8 -> (N, H*W) grey in [0, 1]: what the classifier reads."""
    return rgb_uint8.astype(np.float64).mean(axis=-1).reshape(len(rgb_uint8), -1) / 255.0


def read_folder(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    images, labels = [], []
    for path in sorted(folder.glob("*/*.png")):
        images.append(np.asarray(Image.open(path).convert("RGB")))
        labels.append(int(path.parent.name))
    return np.stack(images), np.array(labels)


def train_classifier(folder: Path):
    """Logistic regression on the real digits; returns it and its accuracy on a held-out fifth."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    images, labels = read_folder(folder)
    features = grey_features(images)
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.2, random_state=0, stratify=labels
    )
    classifier = LogisticRegression(max_iter=3000).fit(x_train, y_train)
    return classifier, float(classifier.score(x_test, y_test))


def score_samples(classifier, singles: Path) -> dict:
    """The share of `dit-accel sample` singles (NNNNNN_classK.png) the classifier reads as class K."""
    from PIL import Image

    paths = sorted(singles.glob("*.png"))
    images = np.stack([np.asarray(Image.open(path).convert("RGB")) for path in paths])
    wanted = np.array([int(path.stem.split("_class")[1]) for path in paths])
    predicted = classifier.predict(grey_features(images))
    per_class = {int(k): float((predicted[wanted == k] == k).mean()) for k in sorted(set(wanted.tolist()))}
    return {"correct": float((predicted == wanted).mean()), "samples": len(paths), "per_class": per_class}


# --- the two sides -----------------------------------------------------------------------------------------


def run(command: list[str], env: dict, log_path: Path) -> None:
    with log_path.open("w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}; see {log_path}")


def make_plan(args, out: Path, env: dict) -> Path:
    plan = out / "plan"  # planned anew each time (under a second): --batch may have changed
    run(
        [
            "dit-plan",
            "--gpus",
            "1",
            "--vram",
            "80G",
            "--global-batch",
            str(args.batch),
            "--latents",
            "pixel",
            "--resolution",
            str(RESOLUTION),
            *NETWORK,
            "--precision",
            "fp32",
            "--sharding",
            "ddp",
            "--checkpointing",
            "none",
            "--max-micro-batch",
            str(args.batch),
            "--out",
            str(plan),
        ],
        env,
        out / "plan.log",
    )
    return plan / "plan.json"


def train_dit_accel(args, out: Path, seed: int, env: dict) -> tuple[Path, list[tuple[int, float]]]:
    run_dir = out / "runs" / f"dit-accel_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    command = [
        sys.executable,
        "-m",
        "dit_accel.train",
        "--plan",
        str(make_plan(args, out, env)),
        "--data-path",
        str(out / "data" / "images"),
        "--output-dir",
        str(run_dir),
        "--max-steps",
        str(args.steps),
        "--checkpoint-every",
        str(args.steps),
        "--log-every",
        str(args.log_every),
        "--lr",
        str(args.lr),
        "--ema-decay",
        str(args.ema_decay),
        "--class-dropout",
        "0.1",
        "--seed",
        str(seed),
        "--num-workers",
        "0",
        "--no-tensorboard",
        "--no-progress-bar",
        "--no-tf32",  # fp32 as planned, as the original loop below runs (torch's default: no TF32)
    ]
    run(command, env, out / "logs" / f"dit-accel_seed{seed}_train.log")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [(m["step"], m["loss"]) for m in metrics]


def original_env(args, out: Path, env: dict) -> dict:
    """The environment of a child that imports the original: its checkout and the torchvision stub first."""
    shim = out / "shim" / "torchvision"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(TORCHVISION_STUB)
    return dict(env, PYTHONPATH=os.pathsep.join([str(out / "shim"), str(Path(args.original_dit).resolve())]))


def check_equivalence(args, out: Path, env: dict) -> dict:
    """`equivalence_worker` in a child process; its report (also RESULTS/equivalence.json)."""
    path = out / "equivalence.json"
    command = [sys.executable, __file__, "equivalence-worker", str(out / "data" / "images"), str(path)]
    run(command, original_env(args, out, env), out / "logs" / "equivalence.log")
    return json.loads(path.read_text())


def train_original(args, out: Path, seed: int, env: dict) -> tuple[Path, list[tuple[int, float]]]:
    """The original's network and diffusion, trained in a child process (its imports stay out of ours)."""
    checkpoint = out / "runs" / f"original_seed{seed}.pt"
    curve = out / "runs" / f"original_seed{seed}_curve.json"
    child_env = original_env(args, out, env)
    command = [
        sys.executable,
        __file__,
        "original-worker",
        "--data",
        str(out / "data" / "images"),
        "--seed",
        str(seed),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--lr",
        str(args.lr),
        "--ema-decay",
        str(args.ema_decay),
        "--log-every",
        str(args.log_every),
        "--checkpoint",
        str(checkpoint),
        "--curve",
        str(curve),
    ]
    run(command, child_env, out / "logs" / f"original_seed{seed}_train.log")
    run_dir = out / "runs" / f"original_seed{seed}"
    for weights, folder in (("ema", run_dir), ("model", raw_weights_dir(run_dir))):  # EMA, and raw weights
        run(
            ["dit-accel", "import-dit", "--checkpoint", str(checkpoint), "--out", str(folder), "--heads", "4"]
            + ["--weights", weights, "--overwrite"],
            env,
            out / "logs" / f"original_seed{seed}_import_{weights}.log",
        )
    return run_dir, [tuple(point) for point in json.loads(curve.read_text())]


def original_worker(argv: list[str]) -> None:
    """The original train.py's recipe, minus DDP and the VAE (pixel space), on this machine's CPU."""
    from copy import deepcopy

    import torch
    from diffusion import create_diffusion  # from --original-dit, on PYTHONPATH
    from models import DiT
    from PIL import Image

    parser = argparse.ArgumentParser()
    for name in ("--data", "--checkpoint", "--curve"):
        parser.add_argument(name, required=True)
    for name in ("--seed", "--steps", "--batch", "--log-every"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--ema-decay", type=float, required=True)
    args = parser.parse_args(argv)

    paths = sorted(Path(args.data).glob("*/*.png"))
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()) for p in paths])
    pixels = pixels.permute(0, 3, 1, 2).float().div(255.0).sub(0.5).div(0.5)  # ToTensor + Normalize(0.5, 0.5)
    labels = torch.tensor([int(p.parent.name) for p in paths])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pixels, labels = pixels.to(device), labels.to(device)

    torch.manual_seed(args.seed)  # as train.py: the seed, then the model (its own initialisation)
    model = DiT(
        input_size=RESOLUTION, patch_size=2, in_channels=3, hidden_size=128, depth=4, num_heads=4,
        class_dropout_prob=0.1, num_classes=10, learn_sigma=True,
    )  # fmt: skip
    model = model.to(device)
    ema = deepcopy(model).requires_grad_(False)
    diffusion = create_diffusion(timestep_respacing="")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0)
    model.train()  # class dropout happens inside the model in train mode
    ema.eval()
    order = torch.Generator().manual_seed(args.seed)
    curve, window, step = [], [], 0
    while step < args.steps:
        permutation = torch.randperm(len(pixels), generator=order).to(device)
        for first in range(0, len(pixels) - args.batch + 1, args.batch):  # drop_last
            index = permutation[first : first + args.batch]
            x, y = pixels[index].clone(), labels[index]
            flip = torch.rand(len(x), device=device) < 0.5  # RandomHorizontalFlip
            x[flip] = x[flip].flip(-1)
            t = torch.randint(0, diffusion.num_timesteps, (len(x),), device=device)
            loss = diffusion.training_losses(model, x, t, dict(y=y))["loss"].mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():  # train.py's update_ema
                ema_params, params = dict(ema.named_parameters()), dict(model.named_parameters())
                for name, param in params.items():
                    ema_params[name].mul_(args.ema_decay).add_(param.data, alpha=1 - args.ema_decay)
            window.append(loss.item())
            step += 1
            if step % args.log_every == 0:
                curve.append((step, sum(window) / len(window)))
                print(f"step {step} loss {curve[-1][1]:.4f}", flush=True)
                window = []
            if step == args.steps:
                break
    on_cpu = lambda module: {name: value.cpu() for name, value in module.state_dict().items()}  # noqa: E731
    torch.save({"model": on_cpu(model), "ema": on_cpu(ema)}, args.checkpoint)
    Path(args.curve).write_text(json.dumps(curve))


def equivalence_worker(argv: list[str]) -> None:
    """The same initial weights and batches through both: per-sample loss terms, gradients, then 10 AdamW +
    EMA steps. dit-accel's model is the original's weights read by `load_original_dit` (so it has the
    original's timestep shift, 0); the batch includes t = 0 (the decoder NLL) and dropped labels."""
    from copy import deepcopy

    import torch
    from diffusion import create_diffusion  # from --original-dit, on PYTHONPATH
    from models import DiT

    from dit_accel.diffusion.objective import Diffusion
    from dit_accel.models.dit import as_model_fn
    from dit_accel.models.original_dit import load_original_dit, original_to_diffusers_state_dict
    from dit_accel.train.ema import EMA
    from dit_accel.train.optim import build_optimizer

    data, out_path = Path(argv[0]), Path(argv[1])
    images, labels = read_folder(data)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(labels)
    as_diffusers = lambda state: original_to_diffusers_state_dict(state, 4)  # noqa: E731
    torch.manual_seed(0)
    original = DiT(
        input_size=RESOLUTION,
        patch_size=2,
        in_channels=3,
        hidden_size=128,
        depth=4,
        num_heads=4,
        num_classes=10,
        learn_sigma=True,
    ).eval()  # fmt: skip  (eval: labels are dropped by hand below, identically for both)
    ours = load_original_dit({k: v.clone() for k, v in original.state_dict().items()}, heads=4).train()
    original_ema, our_ema = deepcopy(original).requires_grad_(False), EMA(ours, 0.995)
    original_diffusion, our_diffusion = create_diffusion(timestep_respacing=""), Diffusion.linear()
    original_opt = torch.optim.AdamW(original.parameters(), lr=2e-3, weight_decay=0)
    our_opt = build_optimizer(ours, 2e-3, (0.9, 0.999), 0.0, "cpu")
    generator = torch.Generator().manual_seed(0)
    report, losses = {}, []
    for step in range(10):
        index = torch.randperm(len(pixels), generator=generator)[:64]
        x, y = pixels[index], labels[index].clone()
        y[torch.rand(64, generator=generator) < 0.1] = 10  # the null class
        t = torch.randint(0, 1000, (64,), generator=generator)
        t[:2] = 0 if step == 0 else t[:2]
        noise = torch.randn(x.shape, generator=generator)
        theirs = original_diffusion.training_losses(original, x, t, dict(y=y), noise=noise)
        mine = our_diffusion.training_losses(as_model_fn(ours), x, y, t=t, noise=noise)
        if step == 0:
            for term in ("mse", "vb", "loss"):
                report[f"step1_max_abs_diff_{term}"] = (theirs[term] - mine[term]).abs().max().item()
        original_opt.zero_grad()
        our_opt.zero_grad()
        theirs["loss"].mean().backward()
        mine["loss"].mean().backward()
        if step == 0:
            grads = as_diffusers({n: p.grad for n, p in original.named_parameters() if p.grad is not None})
            report["step1_max_rel_grad_diff"] = max(
                ((p.grad - grads[n]).norm() / grads[n].norm().clamp(min=1e-12)).item()
                for n, p in ours.named_parameters()
            )
        original_opt.step()
        our_opt.step()
        our_ema.update(ours)
        with torch.no_grad():
            shadow = dict(original_ema.named_parameters())
            for name, param in original.named_parameters():
                shadow[name].mul_(0.995).add_(param, alpha=0.005)
        losses.append((theirs["loss"].mean().item(), mine["loss"].mean().item()))
    weights, ema = as_diffusers(original.state_dict()), as_diffusers(original_ema.state_dict())

    def worst(mine: dict, theirs: dict) -> tuple[float, str]:
        # Attention key biases are left out: softmax ignores them, their gradient is float noise (equivalence.py)
        return max(
            (((value - theirs[name]).norm() / theirs[name].norm().clamp(min=1e-12)).item(), name)
            for name, value in mine.items()
            if not name.endswith("to_k.bias")
        )

    report["losses_10_steps"] = losses
    report["after_10_steps_max_rel_weight_diff"] = worst(dict(ours.named_parameters()), weights)
    report["after_10_steps_max_rel_ema_diff"] = worst(our_ema.shadow, ema)
    out_path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def raw_weights_dir(original_run: Path) -> Path:
    """Where the original side's raw (not EMA) weights are imported."""
    return original_run.with_name(original_run.name + "_raw")


def sample_and_score(
    args, out: Path, name: str, run_dir: Path, seed: int, classifier, env: dict, ema: bool = True
) -> dict:
    grid = out / "samples" / f"{name}.png"
    grid.parent.mkdir(parents=True, exist_ok=True)
    command = [
        "dit-accel",
        "sample",
        "--checkpoint",
        str(run_dir),
        "--classes",
        ",".join(map(str, range(10))),
    ]
    command += ["--per-class", str(args.per_class), "--cfg-scale", str(args.cfg_scale), "--steps"]
    command += [str(args.sample_steps), "--sampler", "ddpm", "--seed", str(seed), "--out", str(grid)]
    command += ["--batch-size", str(10 * args.per_class)]
    command += [] if ema else ["--no-ema"]
    run(command, env, out / "logs" / f"{name}_sample.log")
    return score_samples(classifier, grid.with_name(grid.stem + "_images"))


# --- the comparison ---------------------------------------------------------------------------------------


def write_curve(path: Path, side: str, seed: int, curve: list[tuple[int, float]]) -> None:
    """curves.csv with this run's rows in place of any earlier run's of the same side and seed."""
    rows = []
    if path.exists():
        with path.open() as handle:
            rows = [r for r in csv.DictReader(handle) if (r["side"], r["seed"]) != (side, str(seed))]
    rows += [
        {"side": side, "seed": str(seed), "step": str(step), "loss": f"{loss:.5f}"} for step, loss in curve
    ]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["side", "seed", "step", "loss"])
        writer.writeheader()
        writer.writerows(rows)


def summary_lines(scores: dict, curves_path: Path, sides: list[str]) -> list[str]:
    """Per side and seed: the share correct, the last logged loss; then the mean loss curves side by side."""
    lines = ["| side | seed | correct (EMA) | correct (raw weights) | final loss | train s |"]
    lines.append("|---|---|---|---|---|---|")
    for side in sides:
        runs = sorted(scores.get(side, {}).items())
        for seed, result in runs:
            correct, raw = (
                "-" if result.get(key) is None else f"{result[key]:.3f}" for key in ("correct", "correct_raw")
            )
            lines.append(
                f"| {side} | {seed} | {correct} | {raw} | {result['final_loss']:.4f} | {result['train_s']} |"
            )
        values = [r["correct"] for _, r in runs if r["correct"] is not None]
        if values:
            lines.append(f"| {side} | mean | {np.mean(values):.3f} +- {np.std(values):.3f} | | | |")
    with curves_path.open() as handle:
        rows = list(csv.DictReader(handle))
    steps = sorted({int(row["step"]) for row in rows})
    lines += ["", "| step | " + " | ".join(f"{side} loss (mean +- std over seeds)" for side in sides) + " |"]
    lines.append("|---|" + "---|" * len(sides))
    for step in steps:
        cells = []
        for side in sides:
            values = [float(r["loss"]) for r in rows if r["side"] == side and int(r["step"]) == step]
            cells.append(
                f"{np.mean(values):.4f} +- {np.std(values):.4f} (n={len(values)})" if values else "-"
            )
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["original-worker"]:
        original_worker(argv[1:])
        return 0
    if argv[:1] == ["equivalence-worker"]:
        equivalence_worker(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument("--original-dit", help="a facebookresearch/DiT checkout outside this repository")
    parser.add_argument("--sides", default="dit-accel,original", help="which sides to run")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ema-decay", type=float, default=0.995)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--sample-steps", type=int, default=100)
    parser.add_argument("--cfg-scale", type=float, default=4.0)
    parser.add_argument("--per-class", type=int, default=100, help="samples per digit; 0: no sampling")
    parser.add_argument(
        "--raw-weights-too", action="store_true", help="also score samples of the raw (not EMA) weights"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    sides = [side for side in args.sides.split(",") if side]
    if "original" in sides and not args.original_dit:
        print("the original side needs --original-dit PATH (a DiT checkout); running dit-accel only")
        sides.remove("original")
    if args.original_dit and not (Path(args.original_dit) / "models.py").exists():
        sys.exit(f"{args.original_dit} has no models.py: pass a checkout of facebookresearch/DiT")

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    write_digits(out / "data" / "images")
    classifier, real_accuracy = train_classifier(out / "data" / "images")
    print(f"classifier: {real_accuracy:.3f} on held-out real digits")

    if "original" in sides:
        equivalence = check_equivalence(args, out, env)
        print("same weights, same batches:", {k: v for k, v in equivalence.items() if k != "losses_10_steps"})
    scores_path = out / "scores.json"
    scores = json.loads(scores_path.read_text()) if scores_path.exists() else {}
    scores["classifier_real_accuracy"] = real_accuracy
    scores["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "original_dit")}
    scores["machine"] = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} thread(s)"
    )
    curves_path = out / "curves.csv"
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side in sides:
            name = f"{side}_seed{seed}"
            start = time.perf_counter()
            train = train_dit_accel if side == "dit-accel" else train_original
            run_dir, curve = train(args, out, seed, env)
            train_s = time.perf_counter() - start
            result = {"correct": None, "samples": 0}  # --per-class 0: learning curves only
            if args.per_class > 0:
                result = sample_and_score(args, out, name, run_dir, seed, classifier, env)
            if args.per_class > 0 and args.raw_weights_too:
                raw_dir = run_dir if side == "dit-accel" else raw_weights_dir(run_dir)
                raw = sample_and_score(args, out, name + "_raw", raw_dir, seed, classifier, env, ema=False)
                result.update(correct_raw=raw["correct"], per_class_raw=raw["per_class"])
            result.update(train_s=round(train_s, 1), sample_s=round(time.perf_counter() - start - train_s, 1))
            result["final_loss"] = curve[-1][1]
            scores.setdefault(side, {})[str(seed)] = result
            write_curve(curves_path, side, seed, curve)
            scores_path.write_text(json.dumps(scores, indent=1))
            print(
                f"{name}: {result['correct']} correct, train {train_s:.0f} s, final loss {curve[-1][1]:.4f}"
            )
    lines = summary_lines(scores, curves_path, sides)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
