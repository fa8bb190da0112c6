"""The serving engine on the host: requests and their admission across tenants, prefill batching, the step
loop over the slot functions (serve/slots), read-back into deliveries, drafting, the state cache and the
engine's counters. Knows nothing of HTTP; serve/api sits on it."""
