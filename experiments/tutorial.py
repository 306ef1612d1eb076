"""Tutorial: two custom steps, the smallest pipeline that shows every placeholder.

    marin run experiments/tutorial.py --prefix /tmp/tutorial     # or: python experiments/tutorial.py

`numbers` writes 0..n-1 to a file; `total` sums those at or above a threshold. docs/user-guide.md
walks through it line by line. Run it twice: the second run finds both steps finished. Change
`min_value` and run `marin explain experiments/tutorial.py --prefix /tmp/tutorial`: only `total` would
run again, and explain names the field that changed.
"""

import dataclasses
import json

import fsspec

from marin.execution import ExecutorStep, executor_main, output_path_of, this_output_path


@dataclasses.dataclass(frozen=True)
class WriteConfig:  # every field is part of the step's version (its hash) unless declared live("why")
    output_path: str  # this_output_path(): the step's own directory, {prefix}/{name}-{hash}
    n: int = 100


def write_numbers(config: WriteConfig) -> None:
    with fsspec.open(f"{config.output_path}/numbers.txt", "w") as f:
        f.writelines(f"{i}\n" for i in range(config.n))


@dataclasses.dataclass(frozen=True)
class SumConfig:
    input_path: str  # output_path_of(numbers, "numbers.txt"): resolved to a concrete path before fn runs
    output_path: str
    min_value: int = 0


def sum_numbers(config: SumConfig) -> None:
    with fsspec.open(config.input_path) as f:
        total = sum(v for v in map(int, f.read().split()) if v >= config.min_value)
    with fsspec.open(f"{config.output_path}/sum.json", "w") as f:
        json.dump({"sum": total}, f)


numbers = ExecutorStep(
    name="tutorial/numbers",
    fn=write_numbers,
    config=WriteConfig(output_path=this_output_path(), n=1000),
)
total = ExecutorStep(
    name="tutorial/sum",
    fn=sum_numbers,
    config=SumConfig(
        input_path=output_path_of(numbers, "numbers.txt"),
        output_path=this_output_path(),
        min_value=10,
    ),
    description="Sum of the numbers >= 10",
    resources={"num_cpus": 1},
)

if __name__ == "__main__":
    executor_main(
        steps=[total],
        description="Tutorial: numbers -> sum",
        # the experiment card: shown at the top of `marin report`, next to what happened (not versioned)
        hypothesis="The sum of the integers 10..999 is 499,455 (the arithmetic series (10 + 999) x 990 / 2).",
        goal="Both steps succeed and sum.json holds 499455; a second run recomputes nothing.",
        risks="None worth a plan: two CPU steps on local disk.",
        contingency="If the sum is wrong, `marin show tutorial/sum` prints the step's config and error.",
    )
