"""Prompts for benchmarks/bench_speculative.py: input-grounded tasks (the answer reuses the prompt's
text), verbatim copies, and open-ended chat. Written for this benchmark; the passages are invented."""

PASSAGE_HARBOUR = """\
The harbour town of Vellmoor grew up around a single stone pier built in 1742 by a guild of salt
merchants. For most of the eighteenth century the pier handled salt, timber and dried fish, and the
town's population stayed below two thousand people. Everything changed in 1851, when a railway line
reached the coast and the merchants' pier was extended by three hundred metres to take steam ships.
Within twenty years the population had risen to eleven thousand, and the old salt warehouses along
the quay had been turned into a fish market, a customs house and a sailors' hospital. The railway
closed in 1965, and the fishing fleet, which once counted more than ninety boats, shrank to a dozen
by the end of the century. Today the pier is a protected monument. The fish market still opens every
morning at five o'clock, the customs house is a maritime museum, and the sailors' hospital has become
a school for boat builders that trains about forty apprentices each year."""

PASSAGE_GARDEN = """\
Our community garden has forty-two plots, each three metres by six metres. Plots are rented for one
year at a time, from the first of March to the last day of February. The rent is thirty euros per
year, or fifteen euros for students and retired members. Every member must spend at least six hours
per season on shared work, such as repairing the fences, turning the compost heaps and watering the
herb beds in August. Tools are kept in the green shed next to the main gate; the shed code changes on
the first day of every month and is sent to members by email. Hoses may only be used before nine in
the morning or after six in the evening. Members who leave a plot untended for more than eight weeks
receive a written reminder, and if the plot is still untended four weeks later it is offered to the
next person on the waiting list, which currently holds about thirty names."""

CODE_SNIPPET = '''\
def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) != 4:
                continue
            order_id, customer, amount, status = fields
            orders.append({"id": int(order_id), "customer": customer,
                           "amount": float(amount), "status": status})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        if order["status"] != "paid":
            continue
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals
'''

GROUNDED = [
    f"Summarise the following passage in a few sentences, keeping its facts and figures:\n\n{PASSAGE_HARBOUR}",
    f"Rewrite the following passage as a numbered list of its facts, using its own words:\n\n{PASSAGE_GARDEN}",
    f"Rename the function total_by_customer to paid_totals in this Python code and print the whole code "
    f"again:\n\n{CODE_SNIPPET}",
    f"Add a docstring to each function in this Python code and print the whole code:\n\n{CODE_SNIPPET}",
    f"Repeat the following passage, replacing the town name Vellmoor with Saltby:\n\n{PASSAGE_HARBOUR}",
    f"Answer from the passage: how much is the rent, what are the hose rules, and what happens to an "
    f"untended plot? Quote the passage.\n\n{PASSAGE_GARDEN}",
]

# The ceiling of prompt lookup on this model: answers that are the input itself.
VERBATIM = [
    f"Copy the following text exactly, word for word:\n\n{PASSAGE_HARBOUR}",
    f"Copy the following text exactly, word for word:\n\n{PASSAGE_GARDEN}",
    f"Print this Python code again exactly as it is:\n\n{CODE_SNIPPET}",
]

CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy while working from home?",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me ideas for a weekend trip with friends who like hiking.",
    "Why do cats purr? Give a few possible reasons.",
    "Write a friendly email inviting my neighbours to a garden party.",
]
