"""Images in prompts, for vision-language models: find, fetch, decode, preprocess.

A request names images as TGI does (markdown ``![](URL)`` in ``inputs`` or in a
chat message's text) or as OpenAI does (``image_url`` content parts). For a
model whose engine takes images (``ModelInfo.takes_images``) the gateway:

1. finds them (:mod:`~switchyard.media.markdown`, :mod:`~switchyard.media.intake`);
2. fetches them under the server's limits: ``data:`` URLs always, http(s) only
   from the hosts ``--image-hosts`` allows, with a time and a byte limit
   (:mod:`~switchyard.media.fetch`, :mod:`~switchyard.media.hosts`);
3. decodes them with Pillow under a pixel limit (:mod:`~switchyard.media.decode`);
4. runs the model folder's processor on each, which gives the pixel arrays and
   how many placeholder tokens the image takes (:mod:`~switchyard.media.processor`);
5. tokenizes the prompt with each image's placeholder expanded to that many
   tokens (:mod:`~switchyard.media.prompt`), so images count as input tokens.

The engine gets the token ids and one ``switchyard_spec.ImageInput`` per image.
A problem with an image is the client's: a 422 on TGI's routes, a 400 on
OpenAI's (:mod:`~switchyard.media.errors`).
"""

from switchyard.media.errors import ImageProblem
from switchyard.media.intake import ImageSet, chat_images, tgi_images
from switchyard.media.limits import ImageLimits
from switchyard.media.processor import VisionProcessor, load_vision_processor
from switchyard.media.prompt import EncodedPrompt, encode_prompt

__all__ = [
    "EncodedPrompt",
    "ImageLimits",
    "ImageProblem",
    "ImageSet",
    "VisionProcessor",
    "chat_images",
    "encode_prompt",
    "load_vision_processor",
    "tgi_images",
]
