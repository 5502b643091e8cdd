"""`python -m dit_accel.sample`, what `accelerate launch -m dit_accel.sample` runs in every rank."""

from dit_accel.errors import exit_command
from dit_accel.sample.command import main

exit_command(main)
