"""The verbs (`gaswap search`, `validate`, `bench`, `compare`, `speed`, `plot`, `check-gpu`, ...): each module is
named after its command and stays thin; results folders and reports. May import every other package; nothing
imports `app` but `gaswap.__main__`."""
