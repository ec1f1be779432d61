"""Search spaces for the AutoML study (scripts/tune.py --space configs/search_spaces.py[:VARIANT]).

A space maps a config field (dotted, as on the command line) to how to sample it:
  ("log", low, high)     a float, log-uniform       ("float", low, high)   a float, uniform
  ("int", low, high)     an integer, inclusive      ("choice", [a, b, ...]) one of the values
Every trial is ``train.py --config CONFIG --config.FIELD=VALUE ...`` with one sample of each field. The
ranges are for short trials (3 epochs, as ``make tune``): a 28-epoch run wants a longer warm-up.

  (none)  LARS at a large batch (configs/fashion_mnist.py:large_batch_lars): peak learning rate, warm-up,
          weight decay, momentum and label smoothing. The trust coefficient stays at MLPerf's 0.001: the
          step is proportional to lr x eta, so tuning both would search one direction twice.
  sgd     SGD with momentum (configs/fashion_mnist.py:large_batch): the same with an SGD learning-rate range.
"""


def get_space(variant: str | None = None) -> dict[str, tuple]:
  space = {
    "optimizer.base_lr": ("log", 0.02, 2.0),  # peak lr = base_lr x batch / 256
    "optimizer.warmup_epochs": ("float", 0.25, 1.5),
    "optimizer.weight_decay": ("log", 1e-5, 1e-3),
    "optimizer.momentum": ("float", 0.8, 0.95),
    "optimizer.label_smoothing": ("float", 0.0, 0.2),
  }
  if variant == "sgd":
    space["optimizer.base_lr"] = ("log", 0.02, 1.0)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of search_spaces.py; known: sgd")
  return space
