"""Where work enters the loop: prompt sources (paced, counted, held-out rounds) and the built-in task
families that generate prompts with their answers.
"""
