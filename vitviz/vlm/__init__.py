"""Vision–language models: their vision towers as vitviz models, and for each word of an answer,
where in the image it came from (`vitviz.ask`)."""
