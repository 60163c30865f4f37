"""A module for standby-worker tests: a step that preloads it finds it imported before it runs."""

IMPORTED = True
