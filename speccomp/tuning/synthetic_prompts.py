"""Synthetic instructions for self-distillation: many kinds of request, built from templates.

Draft heads learn what the model says next; they can only learn it from text the model wrote.
The prompt files at hand (two of the four shared files, the other two held out for measurement)
cover a narrow slice of what users ask, so heads trained on them alone learn that slice by heart
and generalize poorly (see README: 0.7 top-1 on training replies, 0.26 on unseen ones). More
*kinds* of request widen what the model's replies cover at no cost in labels: the labels are
still the model's own argmax tokens (speccomp/tuning/train_heads.py).

    synthetic_prompts(500, seed=0)   # -> 500 distinct English instructions, the same for a seed

Every prompt is a template from KINDS filled with a topic, item or numbers drawn with a seeded
`random.Random`. Kinds take turns until one runs out of new combinations (code after ~40, advice
after ~60): up to about 430 prompts the mix is even, beyond that the larger kinds (arithmetic,
stories) fill the rest. Templates and word lists are this project's own; none comes from a benchmark.
"""
from __future__ import annotations

import random

# (kind, templates). "{t}" is a topic, "{o}" an object, "{a}" an activity, "{p}" a place, "{x}"/"{y}"/"{z}"
# numbers, "{n}" a small count, "{f}" a programming task; a template names only the fields it uses.
KINDS: dict[str, list[str]] = {
    "explain": [
        "Explain {t} in simple terms.", "What is {t} and why does it matter?", "How does {t} work?",
        "Can you describe {t} to a ten-year-old?", "Give me a short overview of {t}.",
    ],
    "list": [
        "List {n} interesting facts about {t}.", "What are {n} common mistakes people make with {a}?",
        "Name {n} ways to use {o} that most people do not think of.", "Give me {n} tips for {a}.",
    ],
    "compare": [
        "Compare {t} and {t2}.", "What are the pros and cons of {a}?", "Which is better for a beginner, {a} or {a2}? Why?",
        "What is the difference between {o} and {o2}?",
    ],
    "howto": [
        "How do I get started with {a}?", "Write step-by-step instructions for {a}.",
        "How can I take care of {o} so that it lasts longer?", "What should I prepare before {a}?",
    ],
    "story": [
        "Write a short story about {o} that {e}.", "Write a poem about {t}.", "Tell me a funny story set in {p}.",
        "Write the opening paragraph of a mystery novel set in {p}.", "Describe a day in the life of a {j}.",
    ],
    "letter": [
        "Write an email to my {r} asking to {q}.", "Write a polite message to a neighbour about {o}.",
        "Draft a short speech for a {j} retiring after {x} years.", "Write a product description for {o}.",
    ],
    "advice": [
        "I feel stressed about {s}. What can I do?", "My friend wants to start {a}. What advice would you give?",
        "How can I save money on {o}?", "What should I consider before moving to {p}?",
    ],
    "opinion": [
        "Is {a} a good hobby? Explain your view.", "Why do some people dislike {t}?",
        "What would the world look like without {o}?", "Should schools teach {t}? Give arguments for and against.",
    ],
    "history": [
        "Summarize the history of {o}.", "How has {t} changed over the last hundred years?",
        "Who were the key people in the development of {t}?",
    ],
    "math": [
        "A shop sells {i} for ${x} each. Maria buys {n} and pays with a ${z} bill. How much change does she get?",
        "Tom reads {x} pages a day. His book has {y} pages. How many days does he need to finish it?",
        "A train travels {x} km in {n} hours. What is its average speed?",
        "A farmer has {y} apples. He gives {x} to his neighbour and packs the rest in bags of {n}. "
        "How many bags does he fill?",
        "Lisa earns ${x} per hour and works {n} hours a week. How much does she earn in {m} weeks?",
        "A class has {y} students. {x} of them play football and the rest play chess. What fraction plays chess?",
        "What is {x} percent of {y}? Show your work.", "Solve for n: {n}n + {x} = {y}.",
        "A rectangle is {x} cm long and {n} cm wide. What are its area and its perimeter?",
        "Sam had {y} marbles. He lost {x} and then bought {m} more. How many marbles does he have now?",
    ],
    "code": [
        "Write a Python function that {f}.", "Explain what {c} is in programming, with an example.",
        "How do I {f} in JavaScript?", "Write a SQL query that {g}.", "What does this Python code do? `{py}`",
    ],
}

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "climate change", "inflation", "machine learning",
    "the immune system", "democracy", "volcanoes", "renewable energy", "the stock market", "vaccines",
    "gravity", "the internet", "plate tectonics", "sleep", "nutrition", "meditation", "blockchain",
    "the Roman Empire", "jazz music", "recycling", "electric cars", "the solar system", "DNA",
    "supply and demand", "social media", "ocean currents", "antibiotics", "the printing press",
    "coffee culture", "urban gardening", "quantum computing", "bird migration", "public transport",
    "the Olympic Games", "chess strategy", "time management", "remote work", "honey bees",
]
OBJECTS = [
    "a bicycle", "an old piano", "a smartphone", "a cast-iron pan", "a pair of running shoes", "a houseplant",
    "a wooden table", "a laptop", "a camera", "a backpack", "a garden hose", "a wristwatch", "a kite",
    "a coffee machine", "a library card", "a lighthouse", "a teddy bear", "a violin", "a tent", "a lamp",
]
ACTIVITIES = [
    "running", "learning to cook", "painting", "playing the guitar", "hiking", "learning a new language",
    "baking bread", "swimming", "photography", "gardening", "writing a blog", "yoga", "knitting",
    "rock climbing", "investing", "public speaking", "birdwatching", "camping", "cycling to work", "chess",
]
PLACES = [
    "a small fishing village", "Tokyo", "a desert town", "a busy hospital", "a mountain cabin", "Paris",
    "a space station", "a school library", "an island", "a night market", "a farm", "a train station",
]
EVENTS = [
    "learns to talk", "goes missing", "wins a prize", "travels back in time", "makes a new friend",
    "gets lost in a storm", "finds a secret letter", "saves the day",
]
JOBS = ["teacher", "nurse", "chef", "firefighter", "librarian", "pilot", "farmer", "software engineer", "baker"]
RELATIONS = ["manager", "landlord", "teacher", "colleague", "doctor", "team"]
REQUESTS = [
    "move our meeting to next week", "extend a deadline by two days", "fix the heating", "approve a day off",
    "share the slides from the workshop", "review my report",
]
STRESSORS = ["my exams", "a job interview", "moving house", "a presentation at work", "my finances", "a new job"]
FUNCTIONS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number", "counts the vowels in a text",
    "removes duplicates from a list while keeping the order", "merges two sorted lists",
    "finds the largest number in a list", "reverses the words in a sentence", "converts Celsius to Fahrenheit",
    "checks whether a number is prime", "computes the average of a list of numbers", "sorts a list of names",
    "reads a text file and counts its lines",
]
CONCEPTS = ["recursion", "a hash map", "a closure", "an API", "a unit test", "a linked list", "a race condition"]
ITEMS = ["pencils", "notebooks", "cupcakes", "tickets", "plants", "books", "toy cars", "candles", "mugs", "apples"]
QUERIES = [
    "finds the ten most expensive products", "counts orders per customer", "lists employees hired after 2020",
    "finds customers without any order",
]
SNIPPETS = [
    "print(sum(x * x for x in range(10)))", "words = s.split(); print(len(set(words)))",
    "d = {}; [d.setdefault(len(w), []).append(w) for w in ws]", "print(sorted(xs, key=abs)[:3])",
]


def _fill(template: str, rng: random.Random) -> str:
    t, t2 = rng.sample(TOPICS, 2)
    o, o2 = rng.sample(OBJECTS, 2)
    a, a2 = rng.sample(ACTIVITIES, 2)
    x, n = rng.randint(2, 60), rng.randint(3, 9)
    bill = next(b for b in (20, 50, 100, 200, 500, 1000) if b >= x * n)  # the bill covers the purchase
    values = {
        "t": t, "t2": t2, "o": o, "o2": o2, "a": a, "a2": a2, "p": rng.choice(PLACES), "e": rng.choice(EVENTS),
        "j": rng.choice(JOBS), "r": rng.choice(RELATIONS), "q": rng.choice(REQUESTS), "s": rng.choice(STRESSORS),
        "f": rng.choice(FUNCTIONS), "i": rng.choice(ITEMS), "c": rng.choice(CONCEPTS), "g": rng.choice(QUERIES),
        "py": rng.choice(SNIPPETS),
        "n": n, "m": rng.randint(2, 12), "x": x, "y": x * rng.randint(2, 9) + rng.randint(0, 9),
        "z": bill,
    }
    return template.format(**values)


def synthetic_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct instructions, kinds taken in turn (every kind covered evenly until its templates run
    out of new combinations), fixed for a seed."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of synthetic prompts must be an int >= 1, got {n!r}")
    rng = random.Random(seed)
    kinds = list(KINDS)
    seen, out = set(), []
    while len(out) < n:
        for kind in list(kinds):
            for _ in range(100):  # a kind that draws no new prompt in 100 tries is used up
                text = _fill(rng.choice(KINDS[kind]), rng)
                if text not in seen:
                    seen.add(text)
                    out.append(text)
                    break
            else:
                kinds.remove(kind)
            if len(out) == n:
                break
        if not kinds:
            raise ValueError(f"the templates make only {len(out)} distinct synthetic prompts; ask for at most that many "
                             f"(speccomp train-heads --synthetic N)")
    return out
