"""The toy's chat format, registered as ``model.chat_format=toy`` when the toy package is imported."""
from rstar2_jax import chat

# The toy model learns the protocol from its demonstrations, not from instructions, so a
# one-line system turn will do; it keeps toy trajectories around 100-250 tokens.
TOY_FORMAT = chat.ChatFormat(
    system_prompt=f"Solve the problem. You may call the tool {chat.TOOL_NAME}.",
    user_template="{question}",
)

chat.register_format("toy", TOY_FORMAT)
