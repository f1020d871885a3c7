"""`python -m benchmarks`: run the attention and int4 benchmarks (see `benchmarks/run.py`)."""

from benchmarks.run import main

main()
