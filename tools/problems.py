"""Math, word and logic problems generated from templates with random numbers: the corpora builder's math,
math_reasoning and reasoning requests. Deterministic for a given ``random.Random``."""

from __future__ import annotations

import random

ITEMS = ["apples", "books", "marbles", "pencils", "tickets", "cookies", "stamps", "coins", "shells", "cards"]


def word_problem(rng: random.Random, name: str) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 9)
    item, price, pct = rng.choice(ITEMS), rng.randint(2, 40), rng.choice([10, 20, 25, 50])
    return rng.choice(
        [
            f"{name} has {a} {item}. {name} buys {b} more and then gives away a third of them. How many {item} are "
            "left? Show your steps.",
            f"{name} buys {c} packs of {item} at ${price} each and pays with a ${c * price + rng.randint(1, 50)} bill. "
            f"How much change does {name} get?",
            f"A shop sells {item} for ${price} each. On Saturday it sells {a} and on Sunday {pct}% more than on "
            "Saturday. How much money did it take in over the weekend?",
            f"{name} reads {b} pages a day. The book has {a * c + b} pages. How many days does {name} need to finish "
            "it?",
            f"{name} saves ${b} a week and already has ${a}. How many weeks until {name} can afford something that "
            f"costs ${a + b * c + rng.randint(1, b)}?",
            f"A train travels at {a + 30} km/h for {c} hours and then at {b + 40} km/h for {c - 1 or 1} hours. How far "
            "does it travel in total?",
        ]
    )


def math_question(rng: random.Random) -> str:
    x, a, b = rng.randint(-9, 12), rng.randint(2, 9), rng.randint(-20, 20)
    p = [(rng.randint(-5, 5), rng.randint(-5, 5)) for _ in range(3)]
    return rng.choice(
        [
            f"Solve for x: {a}x + {b} = {a * x + b}.",
            f"What is {rng.randint(12, 99)} multiplied by {rng.randint(12, 99)}? Explain how you computed it.",
            f"The vertices of a triangle are at {p[0]}, {p[1]} and {p[2]}. What is its area?",
            f"What is the sum of the first {rng.randint(5, 40)} positive integers?",
            f"Find the greatest common divisor of {a * rng.randint(3, 20)} and {a * rng.randint(3, 20)}.",
            f"A rectangle is {rng.randint(3, 30)} cm long and {rng.randint(3, 30)} cm wide. What are its area and its "
            "perimeter?",
            f"If a fair die is rolled twice, what is the probability that the total is {rng.randint(2, 12)}?",
            f"Is {rng.randint(50, 400)} a prime number? Explain.",
        ]
    )


def logic_puzzle(rng: random.Random, names: list[str]) -> str:
    a, b, c, d = rng.sample(names, 4)
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    return rng.choice(
        [
            f"{a} is taller than {b}, and {b} is taller than {c}. Is {c} taller than {a}? Explain your reasoning.",
            f"{a}, {b}, {c} and {d} finish a race. {a} finishes before {b}, {c} finishes last, and {d} finishes right "
            f"after {a}. In what order did they finish?",
            f"If today is {rng.choice(days)}, what day of the week will it be {rng.randint(2, 40)} days from now?",
            f"{a} is {b}'s mother, and {c} is {a}'s father. What is {c} to {b}?",
            f"Every {rng.choice(ITEMS)[:-1]} in the box is red. {a} takes one thing out of the box and it is blue. "
            "What can you conclude?",
            f"{a} has twice as many {rng.choice(ITEMS)} as {b}, and {b} has {rng.randint(2, 9)} fewer than {c}, who "
            f"has {rng.randint(10, 30)}. How many does {a} have?",
        ]
    )
