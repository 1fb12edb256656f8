"""Every test model with every optimizer Alpha predicts, economy configuration, a fixed batch
(consecutive gradients nearly parallel): no instrument may fail, warn or go missing.

Guards: Alpha once left its fast path for full-batch momentum SGD (an ill-conditioned
update fit); vmap's performance notes reached the user's warnings. Values are checked
against brute force elsewhere; here the point is that nothing breaks.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cockpit import Cockpit, configuration
from tests.models import PROBLEMS, make_problem, train

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd_nesterov_wd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True,
                                                 weight_decay=1e-3),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.5, dampening=0.3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", PROBLEMS)
def test_economy_runs_clean_on_every_model_and_optimizer(name, optimizer):
    problem = make_problem(name, 8, dtype=torch.float32)
    opt = OPTIMIZERS[optimizer](problem.model.parameters())
    cockpit = Cockpit(problem.model, configuration("economy"), optimizer=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(problem, cockpit, 6, opt)
        cockpit.close()
    assert [str(w.message) for w in caught] == []
    output = cockpit.get_output()
    missing = {(step, key) for step in range(5) for key, value in output[step].items()
               if value is None}
    assert not missing, cockpit.get_notes()
