"""End-to-end runs that use several parts at once: `kha demo` and the continued-training A/B (`kha ab --from`)."""
