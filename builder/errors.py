"""User-facing errors: one line saying what is wrong, where, and what to do."""


class KilnError(Exception):
    """An error the user can fix, shown as one line without a traceback.

    Library messages wrapped into it may span lines; they are folded into one.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
