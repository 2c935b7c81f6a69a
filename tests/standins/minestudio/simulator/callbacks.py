"""Stand-in callbacks: accepted with MineStudio's constructor arguments and otherwise inert."""


class _Callback:
    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs


class SummonMobsCallback(_Callback): ...


class MaskActionsCallback(_Callback): ...


class RewardsCallback(_Callback): ...


class CommandsCallback(_Callback): ...


class FastResetCallback(_Callback): ...


class JudgeResetCallback(_Callback): ...
