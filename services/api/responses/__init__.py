"""The Responses API: a chat underneath, stored responses and background ones."""
