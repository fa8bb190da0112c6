"""Measuring instruments over compiled programs: HLO bytes and collective traffic, the Neuron compatibility
check, timing. They import nothing else from the library; benchmarks, the programs' checks and the tests use them."""
