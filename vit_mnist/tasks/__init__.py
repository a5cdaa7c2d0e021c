"""What a user runs, one module a task: ``train``, ``evaluate`` (with its ``reports``),
``predict``, ``export`` and ``explore``. Each is a plain function the tests call, behind a
``main(cfg)`` that :mod:`vit_mnist.cli` runs; no task imports another: what two share lives
in a part below (``vit_mnist.training``, ``vit_mnist.data``, ``vit_mnist.analysis``)."""
