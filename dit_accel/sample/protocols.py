"""The sampling protocols under which each paper reports its FID-50K, by name (`dit-accel sample --protocol`).

"My FID does not match the paper" is most often a protocol that differs: the sampler and its steps, the
guidance scale and which channels it guides, the guidance interval, a time shift, whether TF32 is on, and
how the 50,000 labels are drawn (every repository here draws them at random, `torch.randint`, which moves
FID by about 0.1 against a balanced draw). Each entry is what the paper's repository runs for the figure it
reports; docs/evaluation.md cites each. No torch here: `sample.args` reads it before anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Protocol:
    """One paper's sampling, as `dit-accel sample` flags (their names), and the figure it gave."""

    model: str  # what the paper sampled
    sampler: str
    steps: int  # dit-accel's count of steps (an ODE's grid of N points is N - 1 steps)
    cfg_scale: float
    guidance: str  # "all" channels or "first3"
    labels: str  # "random" (torch.randint, as every repository) or "balanced"
    tf32: bool
    fid: float
    source: str
    cfg_interval: tuple[float, float] = (0.0, 1.0)  # dit-accel's time: t = 0 data, t = 1 noise
    time_shift: float = 1.0  # the ODE grid's shift (1: even)
    ode_solver: str | None = None
    diffusion_form: str | None = None
    diffusion_norm: float | None = None

    def flags(self) -> dict:
        """The sample flags this protocol sets (attribute name -> value), those its sampler reads."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for info in ("model", "fid", "source"):
            values.pop(info)
        return {name: value for name, value in values.items() if value is not None}


PROTOCOLS = {
    "dit-xl2": Protocol(
        model="DiT-XL/2, 7M steps",
        sampler="ddpm",
        steps=250,
        cfg_scale=1.5,
        guidance="first3",
        labels="random",
        tf32=True,
        fid=2.27,
        source="DiT paper Table 4; facebookresearch/DiT sample_ddp.py (250 DDPM steps, cfg on channels 0-2, "
        "random labels, --tf32 on)",
    ),
    "sit-xl2": Protocol(
        model="SiT-XL/2, 7M steps",
        sampler="sde",
        steps=250,
        cfg_scale=1.5,
        guidance="first3",
        labels="random",
        tf32=True,
        fid=2.06,
        diffusion_form="sigma",
        diffusion_norm=1.0,
        source="SiT paper (arXiv 2401.08740); willisma/SiT sample_ddp.py SDE (Euler-Maruyama, sigma diffusion, "
        "250 steps, Mean last step), forward_with_cfg on channels 0-2, random labels, --tf32 on",
    ),
    "repa-sit-xl2": Protocol(
        model="SiT-XL/2 + REPA, 4M steps (800 epochs)",
        sampler="sde",
        steps=250,
        cfg_scale=1.8,
        guidance="all",
        labels="random",
        tf32=True,
        fid=1.42,
        cfg_interval=(0.0, 0.7),
        diffusion_form="sigma",
        diffusion_norm=1.0,
        source="REPA paper Table 4; sihyun-yu/REPA README (--mode sde --num-steps 250 --cfg-scale 1.8 "
        "--guidance-high 0.7), generate.py (random labels, --tf32 on, guidance on the whole output)",
    ),
    "lightningdit-xl1-64ep": Protocol(
        model="LightningDiT-XL/1 on VA-VAE f16d32, 64 epochs (80K steps at 1024)",
        sampler="ode",
        steps=249,
        cfg_scale=10.0,
        guidance="first3",
        labels="random",
        tf32=True,
        fid=2.11,
        cfg_interval=(0.0, 0.90),
        time_shift=0.3,
        ode_solver="euler",
        source="hustvl/LightningDiT README; configs/reproductions/lightningdit_xl_vavae_f16d32_64ep_cfg.yaml "
        "(ODE euler, 250 grid points, cfg 10.0, cfg_interval_start 0.10, timestep_shift 0.3); inference.py "
        "(forward_with_cfg guides channels 0-2, random labels, TF32 on)",
    ),
    "lightningdit-xl1-800ep": Protocol(
        model="LightningDiT-XL/1 on VA-VAE f16d32, 800 epochs",
        sampler="ode",
        steps=249,
        cfg_scale=6.7,
        guidance="first3",
        labels="random",
        tf32=True,
        fid=1.35,
        cfg_interval=(0.0, 0.875),
        time_shift=0.3,
        ode_solver="euler",
        source="hustvl/LightningDiT README; configs/reproductions/lightningdit_xl_vavae_f16d32_800ep_cfg.yaml "
        "(ODE euler, 250 grid points, cfg 6.7, cfg_interval_start 0.125, timestep_shift 0.3); inference.py",
    ),
}
