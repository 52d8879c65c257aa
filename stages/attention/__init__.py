"""Attention backends: one object per cache kind, chosen once per stage (base.py says what each
does; the families name theirs)."""
