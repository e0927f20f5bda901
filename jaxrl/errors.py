"""The one exception type jaxrl raises for bad configs and bad input.

Its message is a single sentence that names the offending key, file, line or field and the fix.
The CLI prints it without a traceback and exits with status 2.
"""


class ConfigError(ValueError):
  """A bad config or bad input, with one sentence that names the key and the fix."""
