"""The one exception type jaxrl raises for bad configs and bad input.

Its message is a single sentence that names the offending key, file, line or field and the fix.
The CLI prints it without a traceback and exits with status 2.
"""


class ConfigError(ValueError):
  """A bad config or bad input, with one sentence that names the key and the fix."""


def check_choice(key: str, value, choices):
  """Returns `value` if it is one of `choices`; else raises the one-sentence error every
  registry in jaxrl gives: the key, the bad value, the closest valid one, and all of them."""
  import difflib
  choices = list(choices)
  if value in choices:
    return value
  close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
  hint = f" Did you mean {close[0]!r}?" if close else ""
  raise ConfigError(f"{key}={value!r} is not valid.{hint} Choose one of: "
                    f"{', '.join(map(str, choices))}.")
