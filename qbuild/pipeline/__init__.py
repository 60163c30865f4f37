"""The pipeline: recipe → plan → steps → executor → worker → store."""
