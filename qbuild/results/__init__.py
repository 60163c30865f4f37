"""What happens after a run: summary, report, diff, selection, publish, tracking, JUnit, rebuild checks."""
