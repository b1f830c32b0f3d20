"""Code prompts shared by the benchmark scripts (varied lengths, so batches need per-request lengths)."""

CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    print(",
    "def read_lines(path):\n    with open(path) as f:\n",
    "# Sort a list of numbers in place using insertion sort.\ndef insertion_sort(values):\n",
    "x = [i * i for i in range(",
    "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n",
]
