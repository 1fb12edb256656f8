"""Checks of the training loop around Cockpit: misuse found in the loop (never a silent
wrong number) and the gradient the optimizer steps on against the backward passes Cockpit's
hooks saw.

* :mod:`~cockpit.loop_checks.gradient`: GradientMismatch, gradients not zeroed, backward
  passes outside ``with cockpit(step, ...)``.
* :mod:`~cockpit.loop_checks.problems`: steps Cockpit cannot describe (the model changed,
  an empty batch, a backward pass twice through one graph, losses not backpropagated),
  each a (scope, reason) pair; the losses passed.
* :mod:`~cockpit.loop_checks.optimizer`: the optimizer owns the model's parameters.
* :mod:`~cockpit.loop_checks.processes`: every process runs Cockpit, the processes step on
  the same gradient, no process may run out of batches (DistributedDataParallel's join).
"""

from cockpit.loop_checks.gradient import (
    ADDED,
    ONLY_OUTSIDE,
    WATCHED,
    HeldGradients,
    OutsideBackwardWatch,
    gradient_mismatch,
    listed,
    parameters_holding_gradient,
    report_backward_outside,
)
from cockpit.loop_checks.optimizer import (
    check_optimizer_owns_parameters,
    learning_rate,
    model_param_groups,
    stepped_params,
)
from cockpit.loop_checks.problems import (
    BATCH,
    EMPTY_BATCH,
    GRADIENT,
    LOSSES_NOT_BACKPROPAGATED,
    MODEL,
    REPEATED_BACKWARD,
    SAME_FORWARD_AGAIN,
    STEP_BACKWARDS,
    STEPPED_BEFORE_BACKWARD,
    backward_problems,
    check_losses,
    first_problem,
    nonfinite_warning,
    parameters_changed,
    step_problems,
)
from cockpit.loop_checks.processes import (
    JOINING,
    every_rank_attached,
    joining,
    ranks_step_apart,
)

__all__ = [
    "ADDED",
    "BATCH",
    "EMPTY_BATCH",
    "GRADIENT",
    "JOINING",
    "LOSSES_NOT_BACKPROPAGATED",
    "MODEL",
    "ONLY_OUTSIDE",
    "REPEATED_BACKWARD",
    "SAME_FORWARD_AGAIN",
    "STEPPED_BEFORE_BACKWARD",
    "STEP_BACKWARDS",
    "WATCHED",
    "HeldGradients",
    "OutsideBackwardWatch",
    "backward_problems",
    "check_losses",
    "check_optimizer_owns_parameters",
    "every_rank_attached",
    "first_problem",
    "gradient_mismatch",
    "joining",
    "learning_rate",
    "listed",
    "model_param_groups",
    "nonfinite_warning",
    "parameters_changed",
    "parameters_holding_gradient",
    "ranks_step_apart",
    "report_backward_outside",
    "step_problems",
    "stepped_params",
]
