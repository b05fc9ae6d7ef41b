"""Small shared helpers: seeding, thread budgets, timers, metric writers."""
