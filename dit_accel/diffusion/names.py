"""The names the diffusion code accepts, without torch: the flags' modules (`train.config`, `sample.args`)
check against them before anything heavy is imported."""

FLOW_PATHS = ("linear", "gvp")  # the flow objective's interpolants (diffusion.flow)
TIME_SAMPLINGS = ("uniform", "lognormal")  # how the flow objective draws t in training
ODE_SOLVERS = ("heun", "euler")  # the flow ODE sampler's steps (diffusion.flow_sampling)
DIFFUSION_FORMS = ("sigma", "SBDM", "constant", "linear", "decreasing", "increasing-decreasing")  # the SDE's
