"""The serving harness around the metadata library: a paged Llama (``models``), a graph
runner, a continuous-batching engine, the Azure trace, the demo and its report.

It stands in for "an existing decode runner" so that zos can be measured end to end; a
runner that only wants the metadata backend imports :mod:`zos` and never this package.
"""
