"""What runs on the device: the served weights and mesh (loading), the slot table and its compiled programs
(prefill, insert, generate and verify per bucket of rows), per-slot sampling inside them, and their lowering
for another platform. Knows nothing of requests or HTTP: serve/engine drives it, serve/api sits on that."""
