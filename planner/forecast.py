"""What these hours buy: each published FID-50K milestone of a recipe (presets/milestones.yaml) turned into
this plan's steps, wall-clock time, GPU-hours and cost, at equal images seen and at the plan's estimated
images/s; and the cheapest published milestone at or under a target FID.

It is the public record set against this cluster's speed, not a prediction: a run on other data, with other
settings, or with another global batch than the milestone's (named on its row) may land elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources

import yaml

from planner.errors import PlanError

# dit-plan --recipe: a method, or the shipped recipe that trains it (configs/recipes/)
METHODS = ("DiT", "SiT", "REPA", "LightningDiT")
GUIDANCE = ("guided", "unguided")


@dataclass(frozen=True)
class Milestone:
    method: str
    recipe: str
    model: str
    tokenizer: str
    resolution: int
    steps: int
    global_batch: int
    fid_unguided: float | None
    fid_guided: float | None
    protocol: str
    source: str

    @property
    def images_seen(self) -> int:
        return self.steps * self.global_batch

    def fid(self, guidance: str) -> float | None:
        return self.fid_guided if guidance == "guided" else self.fid_unguided


@cache
def milestones() -> tuple[Milestone, ...]:
    """The shipped table (planner/presets/milestones.yaml), in its order."""
    text = resources.files("planner").joinpath("presets/milestones.yaml").read_text()
    return tuple(Milestone(**entry) for entry in yaml.safe_load(text))


def method_of(name: str) -> str:
    """A --recipe value as a method: DiT, SiT, REPA or LightningDiT (any case), or a shipped recipe's name."""
    for method in METHODS:
        if name.lower() == method.lower():
            return method
    by_recipe = {row.recipe: row.method for row in milestones()}
    if name in by_recipe:
        return by_recipe[name]
    names = ", ".join([*METHODS, *sorted(by_recipe)])
    raise PlanError(f"--recipe {name!r} is none of the recipes with published milestones: {names}")


def implied_method(family: str, objective: str, repa: str) -> str:
    """The method a plan's flags train: LightningDiT's network; REPA's alignment; the flow objective (SiT's);
    else DiT's."""
    if family == "lightningdit":
        return "LightningDiT"
    if repa:
        return "REPA"
    return "SiT" if objective == "flow" else "DiT"


def _spend(images: int, global_batch: int, world_size: int, rates: tuple[float, float, float], price) -> dict:
    """Steps, wall-clock (point and range: the fast end of the rate gives the short time), GPU-hours and cost
    of training on `images` images at this plan's estimated images/s."""
    point, low, high = (images / rate for rate in (rates[0], rates[2], rates[1]))
    out = {
        "steps": math.ceil(images / global_batch),
        "time_s": point,
        "time_s_low": low,
        "time_s_high": high,
        "gpu_hours": point * world_size / 3600,
        "cost": None if price is None else point * world_size / 3600 * price,
    }
    return out


def forecast(
    *,
    model: str,
    tokenizer: str,
    resolution: int,
    method: str,
    global_batch: int,
    world_size: int,
    rates: tuple[float, float, float],
    price: float | None = None,
    target_fid: float | None = None,
    guidance: str = "guided",
) -> dict:
    """The plan's "What these hours buy": `rows`, the published milestones of `method` for this network,
    each with this plan's spend to the same images seen (`_spend`); with `target_fid`, `target`: the
    milestone of any method this network runs that reaches it with the fewest of this plan's hours, or,
    when none does, the best published figure (`best`). `rates`: this plan's images/s (point, low, high)."""
    if guidance not in GUIDANCE:
        raise PlanError(f"--target-guidance must be guided or unguided, got {guidance!r}")
    if target_fid is not None and not (math.isfinite(target_fid) and target_fid > 0):
        raise PlanError(f"--target-fid must be a positive FID, got {target_fid}")
    same_network = [
        row
        for row in milestones()
        if (row.model, row.tokenizer, row.resolution) == (model, tokenizer, resolution)
    ]
    notes = []
    if not same_network:
        notes.append(
            f"no published milestone is of {model} at {resolution} px on {tokenizer} latents: the table holds "
            + ", ".join(sorted({f"{row.model} @{row.resolution}" for row in milestones()}))
        )

    def entry(row: Milestone) -> dict:
        spent = _spend(row.images_seen, global_batch, world_size, rates, price)
        return {**asdict(row), "images_seen": row.images_seen, **spent}

    rows = [entry(row) for row in same_network if row.method == method]
    if same_network and not rows:
        notes.append(f"no published milestone of {method} for {model}; its recipes: {_methods(same_network)}")
    if any(row["global_batch"] != global_batch for row in rows):
        notes.append(
            f"the milestones were trained at another global batch than this plan's {global_batch}: they are "
            "set at equal images seen, not equal steps"
        )
    target = best = None
    if target_fid is not None and same_network:
        reaching = [row for row in same_network if (row.fid(guidance) or math.inf) <= target_fid]
        if reaching:
            target = entry(min(reaching, key=lambda row: row.images_seen))
            if target["method"] != method:
                notes.append(
                    f"the target's milestone is {target['method']}'s, timed at this plan's speed for "
                    f"{method}: plan with {target['method']}'s flags for its own (docs/recipes.md)"
                )
        else:
            with_figure = [row for row in same_network if row.fid(guidance) is not None]
            if with_figure:
                best = entry(min(with_figure, key=lambda row: row.fid(guidance)))
    return {
        "method": method,
        "guidance": guidance,
        "target_fid": target_fid,
        "rows": rows,
        "target": target,
        "best": best,
        "notes": notes,
    }


def _methods(rows) -> str:
    return ", ".join(dict.fromkeys(row.method for row in rows))


def target_sentence(forecast_: dict) -> str | None:
    """The one line a --target-fid answer is: the milestone, its source's figure, this plan's hours; or the
    best there is."""
    target_fid, guidance = forecast_["target_fid"], forecast_["guidance"]
    if target_fid is None:
        return None
    hit = forecast_["target"]
    if hit is not None:
        return (
            f"FID {target_fid:g} ({guidance}): reached by {hit['method']} at {hit['steps']:,} of this plan's steps "
            f"({hit['images_seen'] / 1e6:,.1f}M images, published FID {hit[f'fid_{guidance}']:g}), "
            f"{hit['time_s'] / 3600:,.1f} h, {hit['gpu_hours']:,.0f} GPU-hours"
            + (f", ${hit['cost']:,.0f}" if hit["cost"] is not None else "")
        )
    best = forecast_["best"]
    if best is None:
        return (
            f"FID {target_fid:g} ({guidance}): no published milestone of this network states a {guidance} FID"
        )
    return (
        f"FID {target_fid:g} ({guidance}): no published run of this network reached it; the best is "
        f"{best[f'fid_{guidance}']:g} ({best['method']}, {best['steps']:,} of this plan's steps, "
        f"{best['time_s'] / 3600:,.1f} h)"
    )
