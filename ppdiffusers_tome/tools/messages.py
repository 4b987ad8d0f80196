"""Messages the command line and the bench commands both give (a leaf module: ``--help`` imports it without
Paddle)."""

__all__ = ["CALIBRATE_NEEDS_GPU"]

CALIBRATE_NEEDS_GPU = (
    "--calibrate measures where merging starts to pay on a GPU, so it needs --device gpu. On a CPU apply_tome merges "
    "at every size by default (policy='auto' is tomesd's there): nothing to calibrate"
)
