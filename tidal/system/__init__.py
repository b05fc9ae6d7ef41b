"""The system layer: controller (sync/async), staleness manager, buffer, evaluation, run wiring."""
