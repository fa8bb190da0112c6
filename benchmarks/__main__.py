"""`python -m benchmarks NAME [ARGS ...]`: the same as `python -m benchmarks.run`."""

from benchmarks.run import main

if __name__ == "__main__":
  main()
