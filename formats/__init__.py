"""ignis.formats: the bytes of ignis (the .ninfer container, Q4 block layouts, constants, errors)."""
