import logging

# Keeps the plugin's expected warnings off the test output; assertLogs still sees them.
logging.getLogger("sglang_watchdog_plugin").addHandler(logging.NullHandler())
