"""`python -m dit_accel.train`, what `accelerate launch -m dit_accel.train` runs in every rank: the loop."""

from dit_accel.errors import exit_command
from dit_accel.train.loop import main

exit_command(main)
