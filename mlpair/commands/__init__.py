"""The ``mlpair`` subcommands, one module per concern; :mod:`mlpair.cli` parses and dispatches.

- :mod:`~mlpair.commands.serve`: ``serve inference`` and ``serve prediction`` (one process or a
  supervisor of workers).
- :mod:`~mlpair.commands.models`: ``train`` and ``migrate`` (what runs before a deploy).
- :mod:`~mlpair.commands.calls`: ``predict``, ``health`` and ``attributes`` (asking a running
  service, or the schemas, something).
- :mod:`~mlpair.commands.operate`: ``drift-report`` and ``demo``.
- :mod:`~mlpair.commands.outcomes`: ``outcomes-import`` and ``outcomes-report`` (realised outcomes).

Each command is ``f(args: argparse.Namespace) -> int``, the process exit code. Heavy imports
(ONNX Runtime, SQLAlchemy, SciPy, torch) happen inside the command that needs them, so
``mlpair --help`` and a refused start stay fast.
"""
